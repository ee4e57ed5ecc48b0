"""A forward_backward request read straight from its protobuf message, with numpy.

The API checks a body here before it queues it, and the worker turns the stored body into
engine datums here: token ids and loss inputs go from the message's packed little-endian
bytes to numpy arrays (`np.frombuffer`), never through a Python object per value. Every
refusal says, word for word, what `treadle.wire.decode_forward_backward_request` (a body the
wire format refuses) or `convert.check_shapes` (loss inputs that do not fit their datum) says
for the same body, so a client reads the same error whichever path read its request.

Checks come in the order the pydantic path makes them: the wire format of every datum, then
the loss_fn_config, then shapes, before anything is densified.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from pydantic import ValidationError

from core.errors import InvalidInput
from gpu_worker import protocol as ep
from scheduler import convert
from treadle.proto import treadle_wire_pb2 as pb
from treadle.types import ForwardBackwardRequest
from treadle.wire import WireFormatError, parse_forward_backward_request
from treadle.wire.forward_backward import (
    chunk_from_proto,
    first_error,
    loss_config_from_proto,
    read_dtype,
    spans_from_proto,
)

# Wire dtype name -> (numpy dtype of the bytes, bytes per value).
_WIRE = {
    "float32": ("<f4", 4),
    "int64": ("<i8", 8),
    "int32": ("<i4", 4),
    "bfloat16": ("<u2", 2),
}


@dataclasses.dataclass(frozen=True)
class Submission:
    """What the API needs to queue a forward_backward op."""

    model_id: str
    seq_id: int
    forward_only: bool


def read(
    body: bytes, content_encoding: str | None, max_body_bytes: int
) -> pb.ForwardBackwardRequest:
    """The body's message, its wire format checked (datums, loss_fn_config).

    Raises:
        WireFormatError: as `decode_forward_backward_request` raises it for the same body.
        ValidationError: a non-token chunk that `treadle.types` refuses (as the decoder does).
    """
    msg = parse_forward_backward_request(body, content_encoding, max_body_bytes=max_body_bytes)
    check_format(msg)
    return msg


def submission(msg: pb.ForwardBackwardRequest) -> Submission:
    """The fields that queue the op, held to the bounds of `ForwardBackwardRequest`.

    Raises:
        ValidationError: model_id, seq_id or loss_fn_config out of bounds.
    """
    header = ForwardBackwardRequest(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        data=[],
        loss_fn=msg.loss_fn,
        loss_fn_config=loss_config_from_proto(msg),
        forward_only=msg.forward_only,
    )
    return Submission(header.model_id, header.seq_id, header.forward_only)


# ---- wire format ---------------------------------------------------------------------------


def check_format(msg: pb.ForwardBackwardRequest) -> None:
    """Refuse what the pydantic decoder refuses: byte lengths that are not whole values,
    unknown dtypes, tensors whose values do not fill their shape, inconsistent CSR indices,
    malformed image/dmel chunks and provenance spans, and a config value with no arm set."""
    for i, datum in enumerate(msg.data):
        where = f"data[{i}]"
        for j, chunk in enumerate(datum.model_input):
            what = f"{where}.model_input[{j}]"
            if chunk.WhichOneof("chunk") == "encoded_text":
                _count(chunk.encoded_text.tokens, "int32", f"{what} tokens")
            else:  # images and dmel are few per request: read them as the decoder does
                chunk_from_proto(chunk, what)
        for name, tensor in datum.loss_fn_inputs.items():
            _check_tensor(tensor, f"{where}.loss_fn_inputs[{name!r}]")
        if datum.model_input_spans or datum.loss_fn_input_spans:
            try:
                spans_from_proto(datum.model_input_spans)
                spans_from_proto(datum.loss_fn_input_spans)
            except ValidationError as exc:
                raise WireFormatError(f"{where}: {first_error(exc)}") from exc
    loss_config_from_proto(msg)


def _count(buf: bytes, wire_dtype: str, what: str) -> int:
    """How many values `buf` holds, refusing a partial one."""
    _, itemsize = _WIRE[wire_dtype]
    if len(buf) % itemsize:
        name = "uint16" if wire_dtype == "bfloat16" else wire_dtype  # bit patterns, as said
        raise WireFormatError(
            f"{what} holds {len(buf)} bytes, not a whole number of {name} values "
            f"({itemsize} bytes each); send raw little-endian {name} data"
        )
    return len(buf) // itemsize


def _check_tensor(tensor: pb.Tensor, what: str) -> None:
    _, wire_dtype = read_dtype(tensor.dtype, what)
    shape = list(tensor.shape) or None
    if tensor.WhichOneof("encoding") == "sparse_csr":
        csr = tensor.sparse_csr
        values = _count(csr.values, wire_dtype, f"{what} CSR values")
        crow = _count(csr.crow_indices, "int64", f"{what} crow_indices")
        col = _count(csr.col_indices, "int64", f"{what} col_indices")
        problem = _negative(shape) or _csr_problem(shape, csr, values, crow, col)
    else:
        values = _count(tensor.dense, wire_dtype, what)
        problem = _negative(shape)
        if not problem and shape is not None and math.prod(shape) != values:
            problem = (
                f"TensorData shape {shape} needs {math.prod(shape)} values but data holds {values}"
            )
    if problem:
        raise WireFormatError(f"{what}: {problem}")


def _negative(shape: list[int] | None) -> str | None:
    if shape is not None and any(d < 0 for d in shape):
        return f"TensorData shape {shape} has a negative dimension"
    return None


def _csr_problem(
    shape: list[int] | None, csr: pb.SparseCsr, values: int, n_crow: int, n_col: int
) -> str | None:
    if shape is None or len(shape) != 2:
        return (
            f"sparse CSR TensorData needs a 2-D shape [rows, cols], got {shape}; "
            "send the dense shape alongside the CSR indices"
        )
    rows, cols = shape
    if n_crow != rows + 1:
        return f"sparse_crow_indices must have rows + 1 = {rows + 1} entries, got {n_crow}"
    if n_col != values:
        return (
            f"sparse_col_indices has {n_col} entries but data holds {values} values; "
            "CSR data lists exactly one value per column index"
        )
    crow = np.frombuffer(csr.crow_indices, dtype="<i8")
    if crow[0] != 0 or crow[-1] != values or bool(np.any(crow[1:] < crow[:-1])):
        return (
            "sparse_crow_indices must start at 0, never decrease, and end at the number of "
            f"values ({values})"
        )
    col = np.frombuffer(csr.col_indices, dtype="<i8")
    if col.size and (int(col.min()) < 0 or int(col.max()) >= cols):
        return f"sparse_col_indices must lie in [0, {cols}) for shape {shape}"
    return None


# ---- shapes --------------------------------------------------------------------------------


def check_shapes(msg: pb.ForwardBackwardRequest) -> int:
    """`convert.check_shapes` on a format-checked message: token counts from the byte lengths
    of the token chunks, loss-input shapes from their `shape` fields or value counts. Returns
    the tokens of all model inputs (what the request trains, priced before it runs).

    Raises:
        UserInputError: a non-token chunk, or a loss input that does not fit its datum.
    """
    entries = tokens = 0
    for i, datum in enumerate(msg.data):
        n = _token_count(datum, f"data[{i}].model_input")
        tokens += n
        entries += convert.check_datum_shapes(
            i, n, ((name, _dense_shape(t)) for name, t in datum.loss_fn_inputs.items())
        )
    convert.check_total_entries(entries)
    return tokens


def check_request_shapes(msg: pb.ForwardBackwardRequest) -> int:
    """`check_shapes` for the API, where a refusal is a domain error (400); returns the
    tokens of the model inputs."""
    try:
        return check_shapes(msg)
    except ep.UserInputError as exc:
        raise InvalidInput(str(exc)) from exc


def _token_count(datum: pb.Datum, where: str) -> int:
    n = 0
    for chunk in datum.model_input:
        which = chunk.WhichOneof("chunk")
        if which != "encoded_text":
            raise ep.UserInputError(
                f"{where}: to_ints needs token chunks only, but this input has a {which!r} "
                "chunk; send token ids (encoded_text chunks) only"
            )
        n += len(chunk.encoded_text.tokens) // 4
    return n


def _dense_shape(tensor: pb.Tensor) -> list[int]:
    if tensor.shape:
        return list(tensor.shape)
    _, wire_dtype = read_dtype(tensor.dtype, "tensor")
    buf = tensor.sparse_csr.values if tensor.HasField("sparse_csr") else tensor.dense
    return [len(buf) // _WIRE[wire_dtype][1]]


# ---- engine datums -------------------------------------------------------------------------


def datums(msg: pb.ForwardBackwardRequest) -> list[ep.Datum]:
    """The engine's datums: int32 token ids, float32/int64 loss inputs, CSR densified (pad 0).

    Arrays read the message's bytes in place where they can (read-only views); the engine
    copies what it keeps. Shapes are checked first, so nothing oversized is allocated.
    """
    check_shapes(msg)
    return [_datum(datum) for datum in msg.data]


def _datum(datum: pb.Datum) -> ep.Datum:
    parts = [np.frombuffer(c.encoded_text.tokens, dtype="<i4") for c in datum.model_input]
    if len(parts) == 1:
        tokens = parts[0]
    else:
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype="<i4")
    inputs = {name: _array(tensor) for name, tensor in datum.loss_fn_inputs.items()}
    return ep.Datum(tokens=tokens.astype(np.int32, copy=False), loss_fn_inputs=inputs)


def _array(tensor: pb.Tensor) -> np.ndarray:
    """As `TensorData.to_numpy()`: float32 (bfloat16 widened) or int64 (int32 widened)."""
    dtype, wire_dtype = read_dtype(tensor.dtype, "tensor")
    np_dtype = np.float32 if dtype == "float32" else np.int64
    if tensor.WhichOneof("encoding") != "sparse_csr":
        flat = _values(tensor.dense, wire_dtype, np_dtype)
        return flat.reshape(list(tensor.shape) or [flat.size])
    csr = tensor.sparse_csr
    rows, cols = tensor.shape
    out = np.zeros((rows, cols), dtype=np_dtype)
    crow = np.frombuffer(csr.crow_indices, dtype="<i8")
    row_ids = np.repeat(np.arange(rows), np.diff(crow))
    col_ids = np.frombuffer(csr.col_indices, dtype="<i8")
    out[row_ids, col_ids] = _values(csr.values, wire_dtype, np_dtype)
    return out


def _values(buf: bytes, wire_dtype: str, np_dtype: type[np.generic]) -> np.ndarray:
    raw = np.frombuffer(buf, dtype=_WIRE[wire_dtype][0])
    if wire_dtype == "bfloat16":  # the upper half of a float32: widening is exact
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np_dtype, copy=False)


def loss_config(msg: pb.ForwardBackwardRequest) -> dict[str, float] | None:
    """The engine's loss_fn_config (v2 wins over the legacy map; text is refused)."""
    return convert.numeric_loss_config(loss_config_from_proto(msg))
