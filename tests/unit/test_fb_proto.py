"""The numpy path of a forward_backward body against the pydantic path it stands in for.

`scheduler.fb_proto` must refuse exactly what `decode_forward_backward_request` and
`convert.check_shapes` refuse, with the same words, and decode to the same arrays as
`TensorData.to_numpy()`; `convert.forward_backward_output` must write the same bytes as
`encode_forward_backward_output` over `TensorData.from_numpy`.
"""

from __future__ import annotations

import functools
import gzip
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zstandard

from gpu_worker import protocol as ep
from scheduler import convert, fb_proto
from treadle.proto import treadle_wire_pb2 as pb
from treadle.types import ForwardBackwardOutput, TensorData
from treadle.wire import decode_forward_backward_request, encode_forward_backward_output

pytestmark = pytest.mark.unit

N = 6


def _message(
    tokens: list[int] | None = None, inputs: dict[str, pb.Tensor] | None = None
) -> pb.ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest(model_id="run-1", seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.array(
        tokens if tokens is not None else range(10, 10 + N), "<i4"
    ).tobytes()
    for name, tensor in (inputs or {}).items():
        datum.loss_fn_inputs[name].CopyFrom(tensor)
    return msg


def _dense(
    values: Any, dtype: pb.DType = pb.DTYPE_FLOAT32, shape: list[int] | None = None
) -> pb.Tensor:
    wire = {pb.DTYPE_INT64: "<i8", pb.DTYPE_INT32: "<i4"}.get(dtype, "<f4")
    tensor = pb.Tensor(dense=np.asarray(values, wire).tobytes(), dtype=dtype)
    tensor.shape.extend(shape or [])
    return tensor


def _csr(
    shape: list[int] | None, crow: list[int], col: list[int], values: list[float]
) -> pb.Tensor:
    tensor = pb.Tensor(dtype=pb.DTYPE_FLOAT32)
    tensor.sparse_csr.values = np.asarray(values, "<f4").tobytes()
    tensor.sparse_csr.crow_indices = np.asarray(crow, "<i8").tobytes()
    tensor.sparse_csr.col_indices = np.asarray(col, "<i8").tobytes()
    tensor.shape.extend(shape or [])
    return tensor


def _raw_csr(**fields: bytes) -> pb.Tensor:
    tensor = pb.Tensor(dtype=pb.DTYPE_FLOAT32)
    tensor.sparse_csr.SetInParent()
    for name, value in fields.items():
        setattr(tensor.sparse_csr, name, value)
    return tensor


def _outcome(call: Callable[[], object]) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def _same_refusal(body: bytes, encoding: str | None = None) -> tuple[str, str]:
    """Both readers' verdicts on a body, asserted equal; returns it."""
    ours = _outcome(lambda: fb_proto.read(body, encoding, 1 << 30))
    theirs = _outcome(lambda: decode_forward_backward_request(body, encoding))
    assert ours == theirs
    return ours


def _with(edit: Callable[[pb.ForwardBackwardRequest], None]) -> bytes:
    msg = _message()
    edit(msg)
    return msg.SerializeToString()


def _set_input(name: str, tensor: pb.Tensor) -> Callable[[pb.ForwardBackwardRequest], None]:
    return lambda msg: msg.data[0].loss_fn_inputs[name].CopyFrom(tensor)


def _image(fmt: str, override: bool = False) -> Callable[[pb.ForwardBackwardRequest], None]:
    def edit(msg: pb.ForwardBackwardRequest) -> None:
        chunk = msg.data[0].model_input.add().image
        chunk.data, chunk.format = b"\x89PNG", fmt
        if override:
            chunk.override_dimensions.width = 3

    return edit


def _span(sequence_id: str, length: int, empty: bool = False) -> Callable[..., None]:
    def edit(msg: pb.ForwardBackwardRequest) -> None:
        span = msg.data[0].loss_fn_input_spans.add()
        if not empty:
            span.prompt_tokens.sequence_id = sequence_id
            span.prompt_tokens.length = length

    return edit


FORMAT_CASES: dict[str, bytes] = {
    "tokens of 3 bytes": _with(
        lambda m: setattr(m.data[0].model_input[0].encoded_text, "tokens", b"abc")
    ),
    "empty chunk": _with(lambda m: m.data[0].model_input.add()),
    "unknown dtype": _with(_set_input("weights", pb.Tensor(dense=b"\0" * 4))),
    "dtype out of the enum": _with(_set_input("weights", pb.Tensor(dense=b"", dtype=9))),  # type: ignore[arg-type]
    "values of 5 bytes": _with(
        _set_input("weights", pb.Tensor(dense=b"\0" * 5, dtype=pb.DTYPE_FLOAT32))
    ),
    "odd bfloat16 bytes": _with(
        _set_input("weights", pb.Tensor(dense=b"\0" * 3, dtype=pb.DTYPE_BFLOAT16))
    ),
    "shape not filled": _with(_set_input("weights", _dense([1.0] * N, shape=[N, 2]))),
    "negative shape": _with(_set_input("weights", _dense([], shape=[-1, 0]))),
    "csr without shape": _with(_set_input("weights", _csr(None, [0], [], []))),
    "csr 1-D": _with(_set_input("weights", _csr([N], [0], [], []))),
    "csr negative shape": _with(_set_input("weights", _csr([N, -2], [0] * (N + 1), [], []))),
    "csr crow count": _with(_set_input("weights", _csr([N, 4], [0] * N, [], []))),
    "csr col count": _with(_set_input("weights", _csr([N, 4], [0] * N + [1], [], [1.0]))),
    "csr crow start": _with(_set_input("weights", _csr([N, 4], [1] * (N + 1), [0], [1.0]))),
    "csr crow end": _with(_set_input("weights", _csr([N, 4], [0] * (N + 1), [0], [1.0]))),
    "csr crow decreasing": _with(
        _set_input("weights", _csr([N, 4], [0, 2, 1, 1, 1, 1, 2], [0, 1], [1.0, 2.0]))
    ),
    "csr col too large": _with(_set_input("weights", _csr([N, 4], [0] * N + [1], [4], [1.0]))),
    "csr col negative": _with(_set_input("weights", _csr([N, 4], [0] * N + [1], [-1], [1.0]))),
    "csr values of 3 bytes": _with(_set_input("weights", _raw_csr(values=b"abc"))),
    "csr crow of 7 bytes": _with(_set_input("weights", _raw_csr(crow_indices=b"a" * 7))),
    "csr col of 9 bytes": _with(_set_input("weights", _raw_csr(col_indices=b"a" * 9))),
    "image format": _with(_image("gif")),
    "image override": _with(_image("png", override=True)),
    "span without a sequence": _with(_span("", 1)),
    "span with a negative length": _with(_span("s", -1)),
    "span with no arm": _with(_span("", 0, empty=True)),
    "config with no arm": _with(lambda m: m.loss_fn_config_v2["beta"].SetInParent()),
    "no model_id": _with(lambda m: setattr(m, "model_id", "")),
    "JSON": b'{"model_id": "x"}',
    "not protobuf": b"\xff\xff\xff\xff",
}


@pytest.mark.parametrize("case", sorted(FORMAT_CASES))
def test_the_wire_format_is_refused_as_the_pydantic_decoder_refuses_it(case: str) -> None:
    verdict, message = _same_refusal(FORMAT_CASES[case])
    assert verdict != "ok" and message, case


def test_the_first_problem_in_datum_order_is_the_one_reported() -> None:
    msg = _message()
    second = msg.data.add()
    second.model_input.add().encoded_text.tokens = b"ab"
    msg.data[0].loss_fn_inputs["weights"].CopyFrom(_dense([1.0], shape=[2]))
    assert "data[0].loss_fn_inputs['weights']" in _same_refusal(msg.SerializeToString())[1]


def _shape_verdicts(msg: pb.ForwardBackwardRequest) -> tuple[tuple[str, str], tuple[str, str]]:
    body = msg.SerializeToString()
    request = decode_forward_backward_request(body)
    parsed = fb_proto.read(body, None, 1 << 30)
    return (
        _outcome(lambda: fb_proto.check_shapes(parsed)),
        _outcome(lambda: convert.check_shapes(request)),
    )


SHAPE_CASES: dict[str, dict[str, pb.Tensor]] = {
    "fits": {"target_tokens": _dense(range(N), pb.DTYPE_INT64), "weights": _dense([1.0] * N)},
    "one longer": {"weights": _dense([1.0] * (N + 1))},
    "three dimensions": {"weights": _dense([1.0] * N, shape=[N, 1, 1])},
    "many dimensions": {"weights": _dense([1.0] * N, shape=[N, 1, 1, 1, 1, 1])},
    "top-K of 0": {"weights": _dense([], shape=[N, 0])},
    "top-K of 2**62": {"weights": _csr([N, 2**62], [0] * (N + 1), [], [])},
    "top-K of 1024": {"weights": _csr([N, 1024], [0] * (N + 1), [], [])},
    "top-K of 1025": {"weights": _csr([N, 1025], [0] * (N + 1), [], [])},
    "rows not tokens": {"weights": _csr([N + 1, 2], [0] * (N + 2), [], [])},
    "clip of one": {"clip_low_threshold": _dense([0.5]), "clip_high_threshold": _dense([1.5])},
    "clip per token": {"clip_low_threshold": _dense([0.5] * N)},
    "clip of two": {"clip_high_threshold": _dense([1.5, 1.5])},
    "bfloat16 and int32": {
        "weights": pb.Tensor(dense=b"\0" * (2 * N), dtype=pb.DTYPE_BFLOAT16),
        "target_tokens": _dense(range(N), pb.DTYPE_INT32),
    },
    "too many entries": {"weights": _csr([16_400, 1024], [0] * 16_401, [], [])},
}


@pytest.mark.parametrize("case", sorted(SHAPE_CASES))
def test_shapes_are_refused_as_check_shapes_refuses_them(case: str) -> None:
    tokens = list(range(16_400)) if case == "too many entries" else None
    ours, theirs = _shape_verdicts(_message(tokens, SHAPE_CASES[case]))
    assert ours == theirs
    assert (ours[0] == "ok") == (
        case in ("fits", "top-K of 1024", "clip of one", "clip per token", "bfloat16 and int32")
    )


def test_non_token_chunks_and_empty_requests_are_checked_as_before() -> None:
    msg = _message()
    msg.data[0].model_input.add().image.format = "png"
    ours, theirs = _shape_verdicts(msg)
    assert ours == theirs and "send token ids" in ours[1]
    empty = pb.ForwardBackwardRequest(model_id="run-1", seq_id=1, loss_fn="cross_entropy")
    ours, theirs = _shape_verdicts(empty)
    assert ours == theirs == ("ok", "")
    assert fb_proto.datums(fb_proto.read(empty.SerializeToString(), None, 1 << 30)) == []


def _random_tensor(rng: random.Random, n: int) -> pb.Tensor:
    dtype = rng.choice([pb.DTYPE_FLOAT32, pb.DTYPE_INT64, pb.DTYPE_INT32, pb.DTYPE_BFLOAT16])
    two_d = rng.random() < 0.5
    k = rng.randint(1, 5) if two_d else 1
    shape = [n, k] if two_d else ([n] if rng.random() < 0.5 else [])
    nrng = np.random.default_rng(rng.randint(0, 1 << 30))
    wire = {pb.DTYPE_FLOAT32: "<f4", pb.DTYPE_INT64: "<i8", pb.DTYPE_INT32: "<i4"}

    def values(count: int) -> bytes:
        if dtype == pb.DTYPE_BFLOAT16:
            floats = nrng.standard_normal(count).astype("<f4")
            return (floats.view("<u4") >> 16).astype("<u2").tobytes()
        if dtype in (pb.DTYPE_INT64, pb.DTYPE_INT32):
            return nrng.integers(-1000, 1000, count).astype(wire[dtype]).tobytes()
        return nrng.standard_normal(count).astype("<f4").tobytes()

    tensor = pb.Tensor(dtype=dtype)
    if two_d and rng.random() < 0.5:
        mask = nrng.random((n, k)) < 0.4
        tensor.sparse_csr.values = values(int(mask.sum()))
        crow = np.concatenate([[0], np.cumsum(mask.sum(axis=1))])
        tensor.sparse_csr.crow_indices = crow.astype("<i8").tobytes()
        tensor.sparse_csr.col_indices = np.nonzero(mask)[1].astype("<i8").tobytes()
    else:
        tensor.dense = values(n * k)
    tensor.shape.extend(shape)
    return tensor


def _random_request(rng: random.Random) -> pb.ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest(
        model_id="run-1",
        seq_id=rng.randint(1, 100),
        loss_fn=rng.choice(["cross_entropy", "ppo"]),
        forward_only=rng.random() < 0.3,
    )
    if rng.random() < 0.5:
        msg.loss_fn_config["clip_low_threshold"] = 0.5
        msg.loss_fn_config_v2["clip_low_threshold"].number = 0.75
    for _ in range(rng.randint(1, 4)):
        datum = msg.data.add()
        n = 0
        for _ in range(rng.randint(1, 3)):
            chunk = [rng.randint(0, 50_000) for _ in range(rng.randint(0, 9))]
            datum.model_input.add().encoded_text.tokens = np.array(chunk, "<i4").tobytes()
            n += len(chunk)
        for name in rng.sample(["target_tokens", "weights", "advantages", "logprobs"], 3):
            datum.loss_fn_inputs[name].CopyFrom(_random_tensor(rng, n))
    return msg


def _assert_same_datums(ours: list[ep.Datum], theirs: list[ep.Datum]) -> None:
    assert len(ours) == len(theirs)
    for mine, reference in zip(ours, theirs, strict=True):
        assert isinstance(mine.tokens, np.ndarray) and mine.tokens.dtype == np.int32
        assert mine.tokens.tolist() == list(reference.tokens)
        assert sorted(mine.loss_fn_inputs) == sorted(reference.loss_fn_inputs)
        for name, array in reference.loss_fn_inputs.items():
            got = mine.loss_fn_inputs[name]
            assert got.dtype == array.dtype and got.shape == array.shape, name
            np.testing.assert_array_equal(got, array)


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("encoding", [None, "zstd", "gzip"])
def test_datums_equal_the_pydantic_decode_and_to_numpy(seed: int, encoding: str | None) -> None:
    msg = _random_request(random.Random(seed))
    body = msg.SerializeToString()
    if encoding == "zstd":
        body = zstandard.ZstdCompressor().compress(body)
    elif encoding == "gzip":
        body = gzip.compress(body)
    parsed = fb_proto.read(body, encoding, 1 << 30)
    request = decode_forward_backward_request(body, encoding)
    _assert_same_datums(fb_proto.datums(parsed), convert.datums(request))
    assert fb_proto.loss_config(parsed) == convert.loss_config(request)
    submission = fb_proto.submission(parsed)
    assert (submission.model_id, submission.seq_id, submission.forward_only) == (
        request.model_id,
        request.seq_id,
        request.forward_only,
    )


def test_text_config_is_unsupported_as_before() -> None:
    msg = _message()
    msg.loss_fn_config_v2["loss_id"].text = "L-1"
    parsed = fb_proto.read(msg.SerializeToString(), None, 1 << 30)
    request = decode_forward_backward_request(msg.SerializeToString())
    ours = _outcome(lambda: fb_proto.loss_config(parsed))
    assert ours == _outcome(lambda: convert.loss_config(request))
    assert ours[0] == "UnsupportedInput"


# ---- results ---------------------------------------------------------------------------------


def _reference_output(result: ep.ForwardBackwardResult) -> bytes:
    """How results were encoded before the numpy encoder: through TensorData lists."""
    outputs = [
        {name: TensorData.from_numpy(np.ascontiguousarray(a)) for name, a in per.items()}
        for per in result.loss_fn_outputs
    ]
    return encode_forward_backward_output(
        ForwardBackwardOutput(
            loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs, metrics=result.metrics
        )
    )


def _result(outputs: list[dict[str, np.ndarray]]) -> ep.ForwardBackwardResult:
    metrics = {"loss:sum": 1.5, "tokens:sum": 7.0, "ratio:mean": float("nan")}
    return ep.ForwardBackwardResult(outputs, metrics, ep.Usage(trained_tokens=3))


def _random_outputs(rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    outputs = []
    for _ in range(int(rng.integers(0, 6))):
        n = int(rng.integers(0, 5))
        k = int(rng.integers(1, 4))
        logprobs = rng.standard_normal((n, k) if rng.random() < 0.3 else (n,))
        logprobs = logprobs.astype(rng.choice(["float32", "float64", "float16"]))
        if logprobs.size and rng.random() < 0.5:
            logprobs.flat[0] = rng.choice([np.nan, np.inf, -np.inf])
        ids = rng.integers(-(2**40), 2**40, (n,)).astype(rng.choice(["int64", "int32", "bool"]))
        outputs.append({"logprobs": logprobs, "elementwise_loss": logprobs[::-1] * 2, "ids": ids})
    return outputs


@pytest.mark.parametrize("seed", range(40))
def test_output_bytes_equal_the_list_encoder(seed: int) -> None:
    result = _result(_random_outputs(np.random.default_rng(seed)))
    assert convert.forward_backward_output(result) == _reference_output(result)


def test_output_edge_cases_equal_the_list_encoder() -> None:
    cases: list[list[dict[str, np.ndarray]]] = [
        [],
        [{}],
        [{"logprobs": np.zeros(0, np.float32)}, {"logprobs": np.zeros(0, np.float32)}],
        [{"logprobs": np.array(3.5)}, {"logprobs": np.array([1.0, np.nan])}],
        [{"logprobs": np.full((2, 3), -np.inf, np.float32)}, {"logprobs": np.ones(2, np.float32)}],
        [{"logprobs": np.arange(12, dtype=np.float32).reshape(3, 4).T}],  # not contiguous
        [{"x": np.ones(2, np.float32)}, {"x": np.ones(2, np.int64)}, {"x": np.ones(1)}],
        [{"x": np.ones((2, 2))}, {"x": np.ones((1, 2))}, {"x": np.ones((1, 3))}],
    ]
    for outputs in cases:
        result = _result(outputs)
        assert convert.forward_backward_output(result) == _reference_output(result), outputs


def test_output_refusals_match_the_list_encoder() -> None:
    mismatched = _result([{"logprobs": np.ones(2)}, {"other": np.ones(2)}])
    complex_values = _result([{"logprobs": np.ones(2, np.complex64)}])
    bad_metric = ep.ForwardBackwardResult([], {"loss": 1.0}, ep.Usage())
    for result in (mismatched, complex_values, bad_metric):
        ours = _outcome(functools.partial(convert.forward_backward_output, result))
        assert ours[0] != "ok"
        assert ours == _outcome(functools.partial(_reference_output, result))
