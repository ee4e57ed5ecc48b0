"""forward_backward protobuf codec: round trips, and byte compatibility with tinker 0.38.0."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tinker
import zstandard
from tinker.proto import request_conv, response_conv
from tinker.types.provenance_spans import PromptProvenanceSpan as TkPromptSpan
from tinker.types.provenance_spans import SampledProvenanceSpan as TkSampledSpan

from treadle.proto import treadle_wire_pb2 as pb
from treadle.types import (
    Datum,
    DmelChunk,
    EncodedTextChunk,
    ForwardBackwardOutput,
    ForwardBackwardRequest,
    ImageAssetPointerChunk,
    ImageChunk,
    ModelInput,
    PromptProvenanceSpan,
    SampledProvenanceSpan,
    TensorData,
)
from treadle.wire import (
    WireFormatError,
    decode_forward_backward_output,
    decode_forward_backward_request,
    encode_forward_backward_output,
    encode_forward_backward_request,
)

pytestmark = pytest.mark.unit


def _tinker_body(
    data: list[tinker.Datum],
    loss_fn: str = "cross_entropy",
    loss_fn_config: dict[str, float | str] | None = None,
    *,
    seq_id: int = 1,
    forward_only: bool = False,
) -> bytes:
    """Build a body exactly as tinker's `AsyncTrainingResource.forward_backward` does."""
    request = tinker.types.ForwardBackwardRequest(
        forward_backward_input=tinker.types.ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config
        ),
        model_id="sess1:train:0",
        seq_id=seq_id,
    )
    msg = request_conv.forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def test_decodes_tinker_cross_entropy_request() -> None:
    data = [
        tinker.Datum(
            model_input=tinker.ModelInput.from_ints([1, 2, 3, 4]),
            loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [0.0, 1.0, 1.0, 1.0]},
        ),
        tinker.Datum(
            model_input=tinker.ModelInput.from_ints([7, 8]),
            loss_fn_inputs={"target_tokens": [8, 9], "weights": [1.0, 0.5]},
        ),
    ]
    req = decode_forward_backward_request(_tinker_body(data, seq_id=3))
    assert (req.model_id, req.seq_id, req.loss_fn) == ("sess1:train:0", 3, "cross_entropy")
    assert req.forward_only is False and req.loss_fn_config is None
    assert req.data[0].model_input.to_ints() == [1, 2, 3, 4]
    targets = req.data[0].loss_fn_inputs["target_tokens"]
    assert (targets.dtype, targets.shape, targets.data) == ("int64", [4], [2, 3, 4, 5])
    weights = req.data[1].loss_fn_inputs["weights"]
    assert (weights.dtype, weights.shape, weights.data) == ("float32", [2], [1.0, 0.5])


def test_decodes_zstd_body_with_and_without_header() -> None:
    data = [
        tinker.Datum(
            model_input=tinker.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": np.array([6, 7, 8]), "weights": np.ones(3)},
        )
    ]
    body = zstandard.ZstdCompressor().compress(_tinker_body(data, forward_only=True))
    for encoding in ("zstd", None):
        req = decode_forward_backward_request(body, encoding)
        assert req.forward_only is True
        assert req.data[0].loss_fn_inputs["target_tokens"].data == [6, 7, 8]


def test_decodes_rl_losses_config_prefers_v2_and_keeps_strings() -> None:
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={
            "target_tokens": [2, 3, 4],
            "logprobs": [-0.5, -1.0, -2.0],
            "advantages": [1.0, 1.0, -1.0],
        },
    )
    req = decode_forward_backward_request(
        _tinker_body([datum], "ppo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3})
    )
    assert req.loss_fn == "ppo"
    assert req.loss_fn_config == pytest.approx(
        {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}
    )
    assert set(req.data[0].loss_fn_inputs) == {"target_tokens", "logprobs", "advantages"}

    custom = decode_forward_backward_request(_tinker_body([datum], "custom", {"loss_id": "L-1"}))
    assert custom.loss_fn_config == {"loss_id": "L-1"}

    # v2 wins over a stale legacy value.
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="dro")
    msg.loss_fn_config["beta"] = 1.0
    msg.loss_fn_config_v2["beta"].number = 0.25
    assert decode_forward_backward_request(msg.SerializeToString()).loss_fn_config == {"beta": 0.25}


def test_decodes_csr_2d_and_dense_2d_targets() -> None:
    values = np.array([11, 12, 13], dtype=np.int64)
    crow, col = [0, 2, 2, 3], [0, 2, 1]
    sparse_targets = tinker.TensorData(
        data=values, dtype="int64", shape=[3, 4], sparse_crow_indices=crow, sparse_col_indices=col
    )
    sparse_weights = tinker.TensorData(
        data=np.array([0.5, 0.25, 1.0], dtype=np.float32),
        dtype="float32",
        shape=[3, 4],
        sparse_crow_indices=crow,
        sparse_col_indices=col,
    )
    dense_2d = tinker.TensorData.from_numpy(np.arange(6, dtype=np.int64).reshape(3, 2))
    data = [
        tinker.Datum(
            model_input=tinker.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": sparse_targets, "weights": sparse_weights},
        ),
        tinker.Datum(
            model_input=tinker.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={
                "target_tokens": dense_2d,
                "weights": tinker.TensorData.from_numpy(np.full((3, 2), 0.5, np.float32)),
            },
        ),
    ]
    req = decode_forward_backward_request(_tinker_body(data))
    targets = req.data[0].loss_fn_inputs["target_tokens"]
    assert targets.is_sparse and targets.shape == [3, 4]
    assert targets.sparse_crow_indices == crow and targets.sparse_col_indices == col
    assert targets.to_numpy().tolist() == [[11, 0, 12, 0], [0, 0, 0, 0], [0, 13, 0, 0]]
    assert req.data[0].loss_fn_inputs["weights"].to_numpy()[0, 2] == pytest.approx(0.25)
    dense = req.data[1].loss_fn_inputs["target_tokens"]
    assert dense.shape == [3, 2] and dense.tolist() == [[0, 1], [2, 3], [4, 5]]


def test_decodes_multimodal_chunks_and_provenance_spans() -> None:
    dmel = bytes([1, 2, 5, 3]) + b"payload"  # dtype 1, rank 2, dims (5, 3)
    model_input = tinker.ModelInput(
        chunks=[
            tinker.types.EncodedTextChunk(tokens=[1, 2]),
            tinker.types.ImageChunk(data=b"\x89PNG...", format="png", expected_tokens=4),
            tinker.types.DmelChunk(dmel=dmel),
        ]
    )
    datum = tinker.Datum(
        model_input=model_input, loss_fn_inputs={"target_tokens": list(range(11))}
    ).with_provenance(
        model_input=[
            TkPromptSpan(sequence_id="s-1", length=6),
            TkSampledSpan(sequence_id="s-1", offset=0, length=5),
        ],
        loss_fn_inputs=[TkSampledSpan(sequence_id="s-1", offset=1, length=11)],
    )
    req = decode_forward_backward_request(_tinker_body([datum], "stable_reinforce"))
    chunks = req.data[0].model_input.chunks
    assert isinstance(chunks[1], ImageChunk) and chunks[1].data == b"\x89PNG..."
    assert chunks[1].expected_tokens == 4 and chunks[1].format == "png"
    assert isinstance(chunks[2], DmelChunk) and chunks[2].length == 5
    assert req.data[0].model_input.length == 11
    spans = req.data[0].model_input_spans
    assert spans == [
        PromptProvenanceSpan(sequence_id="s-1", offset=0, length=6),
        SampledProvenanceSpan(sequence_id="s-1", offset=0, length=5),
    ]
    assert req.data[0].loss_fn_input_spans == [
        SampledProvenanceSpan(sequence_id="s-1", offset=1, length=11)
    ]


def _own_request() -> ForwardBackwardRequest:
    return ForwardBackwardRequest(
        model_id="s:train:2",
        seq_id=7,
        loss_fn="cross_entropy",
        loss_fn_config={"beta": 0.5, "loss_id": "x"},
        forward_only=True,
        data=[
            Datum(
                model_input=ModelInput(
                    chunks=[
                        EncodedTextChunk(tokens=[1, 2**31 - 1]),
                        ImageChunk(data=b"jpg", format="jpeg"),
                    ]
                ),
                loss_fn_inputs={
                    "target_tokens": TensorData(
                        data=[4, 5],
                        dtype="int64",
                        shape=[2, 3],
                        sparse_crow_indices=[0, 1, 2],
                        sparse_col_indices=[2, 0],
                    ),
                    "weights": [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]],
                },
                model_input_spans=[PromptProvenanceSpan(sequence_id="a", length=2)],
                loss_fn_input_spans=[SampledProvenanceSpan(sequence_id="a", offset=3, length=2)],
            )
        ],
    )


@pytest.mark.parametrize("compress", [False, True])
def test_own_request_round_trips(compress: bool) -> None:
    request = _own_request()
    body = encode_forward_backward_request(request, compress=compress)
    assert decode_forward_backward_request(body) == request


def test_own_request_is_readable_by_tinker_schema() -> None:
    from tinker.proto import tinker_public_pb2

    msg = tinker_public_pb2.ForwardBackwardRequest()
    msg.ParseFromString(encode_forward_backward_request(_own_request()))
    assert msg.seq_id == 7 and msg.forward_only
    assert dict(msg.loss_fn_config) == {"beta": 0.5}  # strings live in v2 only
    assert msg.loss_fn_config_v2["loss_id"].text == "x"
    assert np.frombuffer(msg.data[0].model_input[0].encoded_text.tokens, np.int32).tolist() == [
        1,
        2**31 - 1,
    ]
    assert msg.data[0].loss_fn_inputs["target_tokens"].HasField("sparse_csr")


def test_image_asset_pointer_cannot_be_encoded() -> None:
    request = ForwardBackwardRequest(
        model_id="m",
        seq_id=1,
        loss_fn="cross_entropy",
        data=[
            Datum(
                model_input=ModelInput(
                    chunks=[ImageAssetPointerChunk(format="png", location="s3://b/x.png")]
                )
            )
        ],
    )
    with pytest.raises(ValueError, match="image_asset_pointer"):
        encode_forward_backward_request(request)


@pytest.mark.parametrize(
    ("body", "encoding", "message"),
    [
        (b'{"model_id": "m"}', None, "does not take JSON"),
        (b"\xff\xff\xff", None, "not a valid protobuf"),
        (b"", None, "no model_id"),
        (b"\x28\xb5\x2f\xfdgarbage", None, "not valid zstd"),
        (b"abc", "br", "unsupported Content-Encoding"),
    ],
)
def test_bad_bodies_raise_clear_errors(body: bytes, encoding: str | None, message: str) -> None:
    with pytest.raises(WireFormatError, match=message):
        decode_forward_backward_request(body, encoding)


def test_bad_tensors_raise_clear_errors() -> None:
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = b"\x01\x00\x00"  # 3 bytes
    with pytest.raises(WireFormatError, match=r"data\[0\].model_input\[0\] tokens holds 3 bytes"):
        decode_forward_backward_request(msg.SerializeToString())

    del msg.data[:]
    tensor = msg.data.add().loss_fn_inputs["weights"]
    tensor.dtype = pb.DTYPE_FLOAT32
    tensor.dense = np.zeros(3, np.float32).tobytes()
    tensor.shape.extend([2, 2])
    with pytest.raises(WireFormatError, match=r"loss_fn_inputs\['weights'\].*needs 4 values"):
        decode_forward_backward_request(msg.SerializeToString())

    tensor.ClearField("shape")
    tensor.dtype = pb.DTYPE_UNSPECIFIED
    with pytest.raises(
        WireFormatError, match="DTYPE_UNSPECIFIED; send DTYPE_FLOAT32 or DTYPE_INT64"
    ):
        decode_forward_backward_request(msg.SerializeToString())

    tensor.dtype = pb.DTYPE_INT64
    tensor.sparse_csr.values = np.array([1], np.int64).tobytes()
    tensor.sparse_csr.crow_indices = np.array([0, 1], np.int64).tobytes()
    tensor.sparse_csr.col_indices = np.array([0], np.int64).tobytes()
    with pytest.raises(WireFormatError, match="2-D shape"):
        decode_forward_backward_request(msg.SerializeToString())


def test_decompression_limit() -> None:
    body = zstandard.ZstdCompressor().compress(b"\x00" * 5000)
    with pytest.raises(WireFormatError, match="exceeds 1000 bytes"):
        decode_forward_backward_request(body, "zstd", max_body_bytes=1000)


# ---- outputs ------------------------------------------------------------------------------


def _output() -> ForwardBackwardOutput:
    return ForwardBackwardOutput(
        loss_fn_output_type="TorchLossReturn",
        loss_fn_outputs=[
            {
                "logprobs": TensorData(data=[-0.5, -1.5, -2.5], dtype="float32"),
                "elementwise_loss": TensorData(data=[0.5, 1.5, 2.5], dtype="float32", shape=[3]),
            },
            {
                "logprobs": TensorData(data=[-1.0], dtype="float32"),
                "elementwise_loss": TensorData(data=[1.0], dtype="float32"),
            },
            {  # top-K distillation: (N, K) outputs go to their own record
                "logprobs": TensorData(
                    data=[-1.0, -2.0, -3.0, -4.0], dtype="float32", shape=[2, 2]
                ),
                "elementwise_loss": TensorData(
                    data=[1.0, 2.0, 3.0, 4.0], dtype="float32", shape=[2, 2]
                ),
            },
        ],
        metrics={"loss:sum": 12.5, "tokens:sum": 8.0, "ratio:mean": 0.5},
    )


def test_output_decodes_in_tinker() -> None:
    body = encode_forward_backward_output(_output())
    out = response_conv.deserialize_forward_backward_output(body)
    assert out.loss_fn_output_type == "TorchLossReturn"
    assert out.metrics == {"loss:sum": 12.5, "tokens:sum": 8.0, "ratio:mean": 0.5}
    assert len(out.loss_fn_outputs) == 3
    first = out.loss_fn_outputs[0]["logprobs"]
    assert first.dtype == "float32" and first.shape == [3]
    assert first.to_numpy().tolist() == [-0.5, -1.5, -2.5]
    assert out.loss_fn_outputs[1]["elementwise_loss"].tolist() == [1.0]
    topk = out.loss_fn_outputs[2]["logprobs"]
    assert topk.shape == [2, 2] and topk.tolist() == [[-1.0, -2.0], [-3.0, -4.0]]

    msg = pb.ForwardBackwardOutput()
    msg.ParseFromString(body)
    assert [r.num_datums for r in msg.loss_fn_outputs] == [2, 1]
    assert list(msg.loss_fn_outputs[1].fields["logprobs"].trailing_shape) == [2]
    offsets = np.frombuffer(msg.loss_fn_outputs[0].fields["logprobs"].offsets, np.int64)
    assert offsets.tolist() == [0, 12, 16]  # byte offsets


def test_output_with_int_fields_csr_and_no_datums() -> None:
    output = ForwardBackwardOutput(
        loss_fn_outputs=[
            {
                "ids": TensorData(
                    data=[7, 9],
                    dtype="int64",
                    shape=[2, 2],
                    sparse_crow_indices=[0, 1, 2],
                    sparse_col_indices=[1, 0],
                )
            }
        ],
        metrics={"loss:sum": 0.0},
    )
    out = response_conv.deserialize_forward_backward_output(encode_forward_backward_output(output))
    assert out.loss_fn_outputs[0]["ids"].dtype == "int64"
    assert out.loss_fn_outputs[0]["ids"].tolist() == [[0, 7], [9, 0]]

    empty = ForwardBackwardOutput(metrics={"loss:sum": 0.0})
    out = response_conv.deserialize_forward_backward_output(encode_forward_backward_output(empty))
    assert out.loss_fn_outputs == [] and out.metrics == {"loss:sum": 0.0}


def test_output_round_trips_through_own_decoder() -> None:
    output = _output()
    decoded = decode_forward_backward_output(encode_forward_backward_output(output))
    assert decoded.loss_fn_output_type == output.loss_fn_output_type
    assert decoded.metrics == output.metrics
    for mine, theirs in zip(output.loss_fn_outputs, decoded.loss_fn_outputs, strict=True):
        assert {k: (v.dense_shape, v.data) for k, v in mine.items()} == {
            k: (v.dense_shape, v.data) for k, v in theirs.items()
        }


def test_own_decoder_widens_int32_and_bfloat16() -> None:
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="pkg.module:ArrayRecord")
    record = msg.loss_fn_outputs.add(num_datums=2)
    ids = record.fields["ids"]
    ids.dtype = pb.DTYPE_INT32
    ids.data = np.array([1, 2, 3], np.int32).tobytes()
    ids.offsets = np.array([0, 8, 12], np.int64).tobytes()
    lp = record.fields["logprobs"]
    lp.dtype = pb.DTYPE_BFLOAT16
    lp.data = (
        (np.array([-1.0, 0.5, 2.0], np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    )
    lp.offsets = np.array([0, 4, 6], np.int64).tobytes()
    out = decode_forward_backward_output(msg.SerializeToString())
    assert out.loss_fn_output_type == "ArrayRecord"
    assert [o["ids"].data for o in out.loss_fn_outputs] == [[1, 2], [3]]
    assert out.loss_fn_outputs[0]["ids"].dtype == "int64"
    assert [o["logprobs"].data for o in out.loss_fn_outputs] == [[-1.0, 0.5], [2.0]]


def test_output_rejects_mismatched_fields_and_bad_metric_keys() -> None:
    with pytest.raises(ValueError, match="same fields"):
        encode_forward_backward_output(
            ForwardBackwardOutput(
                loss_fn_outputs=[
                    {"logprobs": TensorData(data=[0.0], dtype="float32")},
                    {"other": TensorData(data=[0.0], dtype="float32")},
                ]
            )
        )
    for key in ("loss", "loss:sum:x", "loss:median"):
        with pytest.raises(ValueError, match="name:reduction"):
            ForwardBackwardOutput(metrics={key: 1.0})


def test_nan_logprobs_survive() -> None:
    output = ForwardBackwardOutput(
        loss_fn_outputs=[{"logprobs": TensorData(data=[math.nan, -1.0], dtype="float32")}]
    )
    out = response_conv.deserialize_forward_backward_output(encode_forward_backward_output(output))
    values = out.loss_fn_outputs[0]["logprobs"].tolist()
    assert math.isnan(values[0]) and values[1] == -1.0
