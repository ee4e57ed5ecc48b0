"""Shared pieces of the protobuf codec: errors, little-endian arrays, tensors, bodies.

Arrays are packed with the standard library's `array` module, so the codec needs neither
numpy nor torch.
"""

from __future__ import annotations

import array
import gzip
import io
import sys
import zlib
from collections.abc import Sequence
from typing import Any

import zstandard
from pydantic import ValidationError

from treadle.errors import TreadleError
from treadle.proto import treadle_wire_pb2 as pb
from treadle.types.tensor import TensorData, TensorDtype

PROTOBUF_CONTENT_TYPE = "application/x-protobuf"
DEFAULT_MAX_BODY_BYTES = 1 << 30

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_GZIP_MAGIC = b"\x1f\x8b"
_LITTLE_ENDIAN = sys.byteorder == "little"

# typecode, item size, readable name
INT32 = ("i", 4, "int32")
INT64 = ("q", 8, "int64")
FLOAT32 = ("f", 4, "float32")
UINT16 = ("H", 2, "uint16")
UINT32 = ("I", 4, "uint32")


class WireFormatError(TreadleError, ValueError):
    """A protobuf body or message that cannot be decoded; the message says what to send."""


class BodyTooLarge(WireFormatError):
    """A compressed body that expands past the size limit (found while decompressing it)."""


def pack(values: Sequence[Any], kind: tuple[str, int, str], what: str) -> bytes:
    """Little-endian bytes of `values` as int32/int64/float32."""
    try:
        arr = array.array(kind[0], values)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"{what} does not fit {kind[2]}: {exc}") from exc
    if not _LITTLE_ENDIAN:  # pragma: no cover - big-endian hosts
        arr.byteswap()
    return arr.tobytes()


def unpack(buf: bytes, kind: tuple[str, int, str], what: str) -> list[Any]:
    typecode, itemsize, name = kind
    if len(buf) % itemsize:
        raise WireFormatError(
            f"{what} holds {len(buf)} bytes, not a whole number of {name} values "
            f"({itemsize} bytes each); send raw little-endian {name} data"
        )
    arr = array.array(typecode)
    arr.frombytes(buf)
    if not _LITTLE_ENDIAN:  # pragma: no cover - big-endian hosts
        arr.byteswap()
    return arr.tolist()


def unpack_bfloat16(buf: bytes, what: str) -> list[float]:
    """bfloat16 bit patterns widened to float32 (exact)."""
    widened = pack([bits << 16 for bits in unpack(buf, UINT16, what)], UINT32, what)
    return unpack(widened, FLOAT32, what)


# Wire dtypes a reader accepts, and what they widen to. Writers only emit FLOAT32 and INT64.
_READ_DTYPES: dict[int, tuple[TensorDtype, str]] = {
    pb.DTYPE_FLOAT32: ("float32", "float32"),
    pb.DTYPE_INT64: ("int64", "int64"),
    pb.DTYPE_INT32: ("int64", "int32"),
    pb.DTYPE_BFLOAT16: ("float32", "bfloat16"),
}
WRITE_DTYPES: dict[TensorDtype, int] = {"float32": pb.DTYPE_FLOAT32, "int64": pb.DTYPE_INT64}


def read_dtype(dtype: int, what: str) -> tuple[TensorDtype, str]:
    found = _READ_DTYPES.get(dtype)
    if found is None:
        name = pb.DType.Name(dtype) if dtype in pb.DType.values() else str(dtype)
        raise WireFormatError(f"{what} has dtype {name}; send DTYPE_FLOAT32 or DTYPE_INT64")
    return found


def unpack_values(buf: bytes, wire_dtype: str, what: str) -> list[Any]:
    if wire_dtype == "bfloat16":
        return unpack_bfloat16(buf, what)
    kind = {"float32": FLOAT32, "int64": INT64, "int32": INT32}[wire_dtype]
    return unpack(buf, kind, what)


def tensor_from_proto(msg: pb.Tensor, what: str) -> TensorData:
    """Decode a dense or CSR `Tensor`; a missing shape means 1-D."""
    dtype, wire_dtype = read_dtype(msg.dtype, what)
    shape = list(msg.shape) or None
    try:
        if msg.WhichOneof("encoding") == "sparse_csr":
            csr = msg.sparse_csr
            return TensorData(
                data=unpack_values(csr.values, wire_dtype, f"{what} CSR values"),
                dtype=dtype,
                shape=shape,
                sparse_crow_indices=unpack(csr.crow_indices, INT64, f"{what} crow_indices"),
                sparse_col_indices=unpack(csr.col_indices, INT64, f"{what} col_indices"),
            )
        return TensorData(data=unpack_values(msg.dense, wire_dtype, what), dtype=dtype, shape=shape)
    except ValidationError as exc:
        raise WireFormatError(f"{what}: {first_error(exc)}") from exc


def tensor_to_proto(tensor: TensorData, msg: pb.Tensor, what: str) -> None:
    """Fill `msg` from `tensor`, keeping a CSR tensor sparse."""
    kind = FLOAT32 if tensor.dtype == "float32" else INT64
    msg.dtype = WRITE_DTYPES[tensor.dtype]  # type: ignore[assignment]
    msg.shape.extend(tensor.dense_shape)
    if tensor.sparse_crow_indices is not None:
        msg.sparse_csr.values = pack(tensor.data, kind, what)
        msg.sparse_csr.crow_indices = pack(tensor.sparse_crow_indices, INT64, what)
        msg.sparse_csr.col_indices = pack(tensor.sparse_col_indices or [], INT64, what)
    else:
        msg.dense = pack(tensor.data, kind, what)


def first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(part) for part in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg


def decompress_body(
    body: bytes, content_encoding: str | None, max_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> bytes:
    """Undo `Content-Encoding` (zstd or gzip; zstd is also recognised by its magic number)."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "identity" and body.startswith(_ZSTD_MAGIC):
        encoding = "zstd"  # a valid message never starts with these bytes
    if encoding == "identity":
        return body
    if encoding == "zstd":
        try:
            with zstandard.ZstdDecompressor().stream_reader(
                io.BytesIO(body), read_across_frames=True
            ) as reader:
                out = _read_limited(reader, max_bytes)
        except zstandard.ZstdError as exc:
            raise WireFormatError(
                f"body is not valid zstd ({exc}); compress it with zstandard or drop "
                "Content-Encoding: zstd"
            ) from exc
        return out
    if encoding in ("gzip", "x-gzip"):
        if not body.startswith(_GZIP_MAGIC):
            raise WireFormatError("body is not gzip data; drop Content-Encoding: gzip")
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(body)) as reader:
                return _read_limited(reader, max_bytes)
        except (OSError, EOFError, zlib.error) as exc:
            raise WireFormatError(f"body is not valid gzip ({exc})") from exc
    raise WireFormatError(
        f"unsupported Content-Encoding {content_encoding!r}; send the body uncompressed "
        "or with Content-Encoding: zstd"
    )


def _read_limited(reader: Any, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = reader.read(1 << 20)
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > max_bytes:
            raise BodyTooLarge(
                f"decompressed body exceeds {max_bytes} bytes; split the batch into "
                "smaller forward_backward requests"
            )
        chunks.append(chunk)
