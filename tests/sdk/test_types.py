"""Behaviour of the wire types themselves: validation, helpers, conversions."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from treadle.types import (
    AdamParams,
    CheckpointPath,
    CopyWeightsRequest,
    Datum,
    DmelChunk,
    EncodedTextChunk,
    ImageAssetPointerChunk,
    ImageChunk,
    LoadWeightsRequest,
    ModelInput,
    OptimStepRequest,
    TensorData,
)

pytestmark = pytest.mark.unit


def test_adam_defaults() -> None:
    assert AdamParams().model_dump() == {
        "learning_rate": 1e-4,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-12,
        "weight_decay": 0.0,
        "grad_clip_norm": 0.0,
    }


def test_model_input_helpers() -> None:
    mi = ModelInput.from_ints([1, 2, 3]).append_int(4)
    assert mi.to_ints() == [1, 2, 3, 4] and mi.length == 4
    assert ModelInput.empty().length == 0
    with_image = mi.append(ImageChunk(data=b"x", format="png", expected_tokens=9))
    assert with_image.length == 13
    with pytest.raises(ValueError, match="'image' chunk"):
        with_image.to_ints()
    with pytest.raises(ValueError, match="expected_tokens"):
        _ = ModelInput(chunks=[ImageAssetPointerChunk(format="png", location="x")]).length
    # dmel length is the first dimension of the TensorContainer header (varint 300 here)
    assert DmelChunk(dmel=bytes([254, 3, 2, 0xAC, 0x02, 80])).length == 300
    with pytest.raises(ValueError, match="TensorContainer"):
        _ = DmelChunk(dmel=b"\x09").length


def test_model_input_json_needs_a_known_chunk_type() -> None:
    with pytest.raises(ValidationError, match="'video'"):
        ModelInput.model_validate({"chunks": [{"type": "video", "tokens": [1]}]})
    with pytest.raises(ValidationError, match="base64"):
        ImageChunk.model_validate({"data": "not base64!", "format": "png"})


def test_tensor_validation_messages() -> None:
    with pytest.raises(ValidationError, match=r"shape \[2, 2\] needs 4 values but data holds 3"):
        TensorData(data=[1, 2, 3], dtype="int64", shape=[2, 2])
    with pytest.raises(ValidationError, match="non-integer"):
        TensorData(data=[1.5], dtype="int64")
    with pytest.raises(ValidationError, match="both sparse_crow_indices"):
        TensorData(data=[1], dtype="int64", shape=[1, 1], sparse_crow_indices=[0, 1])
    with pytest.raises(ValidationError, match="rows \\+ 1 = 3"):
        TensorData(
            data=[1],
            dtype="int64",
            shape=[2, 2],
            sparse_crow_indices=[0, 1],
            sparse_col_indices=[0],
        )
    with pytest.raises(ValidationError, match=r"lie in \[0, 2\)"):
        TensorData(
            data=[1],
            dtype="int64",
            shape=[2, 2],
            sparse_crow_indices=[0, 1, 1],
            sparse_col_indices=[5],
        )
    assert TensorData(data=[1, 2], dtype="float32").data == [1.0, 2.0]
    assert TensorData(data=[1.0, 2.0], dtype="int64").data == [1, 2]


def test_tensor_conversions() -> None:
    csr = TensorData(
        data=[3.0, 4.0],
        dtype="float32",
        shape=[2, 3],
        sparse_crow_indices=[0, 1, 2],
        sparse_col_indices=[2, 0],
    )
    assert csr.tolist() == [[0.0, 0.0, 3.0], [4.0, 0.0, 0.0]]
    assert csr.to_dense(pad_value=-1).data == [-1.0, -1.0, 3.0, 4.0, -1.0, -1.0]
    assert csr.to_numpy(pad_value=-1).tolist() == [[-1.0, -1.0, 3.0], [4.0, -1.0, -1.0]]
    arr = np.arange(12, dtype=np.int32).reshape(3, 4)
    td = TensorData.from_numpy(arr)
    assert (td.dtype, td.shape) == ("int64", [3, 4])
    back = td.to_numpy()
    assert back.dtype == np.int64 and (back == arr).all()
    f = TensorData.from_numpy(np.array([0.1], dtype=np.float64))
    assert f.dtype == "float32" and f.data == [float(np.float32(0.1))]
    assert TensorData.from_list([[1, 2], [3, 4]], "int64").shape == [2, 2]
    assert TensorData(data=[5], dtype="int64").dense_shape == [1]


def test_torch_conversion_reports_missing_extra() -> None:
    pytest.importorskip("numpy")
    try:
        import torch  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"treadle\[torch\]"):
            TensorData(data=[1], dtype="int64").to_torch()
    else:  # pragma: no cover - torch is not installed in the test environment
        assert TensorData(data=[1], dtype="int64").to_torch().tolist() == [1]


def test_datum_coerces_lists_and_arrays() -> None:
    datum = Datum(
        model_input=ModelInput.from_ints([1, 2]),
        loss_fn_inputs={
            "target_tokens": [2, 3],
            "weights": [1, 0],
            "advantages": np.array([0.5, -0.5]),
            "my_mask": [[1, 0], [0, 1]],
        },
    )
    inputs = datum.loss_fn_inputs
    assert (inputs["target_tokens"].dtype, inputs["weights"].dtype) == ("int64", "float32")
    assert inputs["weights"].data == [1.0, 0.0]
    assert inputs["advantages"].dtype == "float32" and inputs["advantages"].shape == [2]
    assert inputs["my_mask"].shape == [2, 2] and inputs["my_mask"].dtype == "int64"
    assert Datum.model_validate(datum.model_dump(mode="json")) == datum


def test_optim_step_needs_exactly_one_param_set() -> None:
    req = OptimStepRequest(model_id="m", seq_id=2, adam_params=AdamParams(learning_rate=1e-3))
    assert req.optim_params.learning_rate == 1e-3
    with pytest.raises(ValidationError, match="exactly one of adam_params"):
        OptimStepRequest(model_id="m")
    with pytest.raises(ValidationError, match="'dimuon'"):
        OptimStepRequest.model_validate(
            {"model_id": "m", "optimizer_params": {"type": "sgd", "learning_rate": 1.0}}
        )


def test_load_weights_addressing() -> None:
    create = LoadWeightsRequest(
        session_id="s", model_seq_id=1, path="tinker://r/weights/x", optimizer=True
    )
    assert create.creates_model
    legacy = LoadWeightsRequest(
        model_id="m", seq_id=2, path="tinker://r/weights/x", optimizer=False
    )
    assert not legacy.creates_model
    with pytest.raises(ValidationError, match="either session_id"):
        LoadWeightsRequest(model_id="m", session_id="s", model_seq_id=1, path="p", optimizer=False)
    with pytest.raises(ValidationError, match="both session_id and model_seq_id"):
        LoadWeightsRequest(session_id="s", path="p", optimizer=False)
    with pytest.raises(ValidationError, match="not both"):
        CopyWeightsRequest(
            source_path="p", destination_project_id="x", session_id="s", model_seq_id=1
        )


def test_checkpoint_paths() -> None:
    path = CheckpointPath.parse("tinker://s:train:0/sampler_weights/final")
    assert (path.training_run_id, path.checkpoint_type, path.name) == (
        "s:train:0",
        "sampler",
        "final",
    )
    assert path.checkpoint_id == "sampler_weights/final"
    assert CheckpointPath.build("r", "external", "e") == "tinker://r/external_weights/e"
    for bad in (
        "s3://r/weights/x",
        "tinker://r/weights",
        "tinker://r/blobs/x",
        "tinker://r/weights/a/b",
    ):
        with pytest.raises(ValueError, match="not a checkpoint path"):
            CheckpointPath.parse(bad)


def test_encoded_text_chunk_json() -> None:
    assert EncodedTextChunk(tokens=[1]).model_dump(mode="json") == {
        "tokens": [1],
        "type": "encoded_text",
    }


def test_every_model_has_a_json_schema() -> None:
    # The server exposes these through FastAPI's OpenAPI document.
    import inspect

    from pydantic import BaseModel

    import treadle.types as types

    models = [
        v
        for n in types.__all__
        if inspect.isclass(v := getattr(types, n)) and issubclass(v, BaseModel)
    ]
    assert len(models) > 100
    for model in models:
        for mode in ("validation", "serialization"):
            schema = model.model_json_schema(mode=mode)
            assert "properties" in schema or "$defs" in schema or schema.get("type") == "object"
    flags = types.ClientConfigResponse.model_json_schema(mode="serialization")["properties"]
    assert "use_pyqwest_transport" in flags


def test_client_config_omits_unset_flags() -> None:
    from treadle.types import ClientConfigResponse, ClientDynamicConfigResponse

    assert ClientConfigResponse().model_dump(mode="json") == {}
    assert ClientConfigResponse(proto_compress_fwdbwd=True).model_dump() == {
        "proto_compress_fwdbwd": True
    }
    assert ClientDynamicConfigResponse().model_dump(mode="json") == {}
