"""Protobuf codec for `/forward_backward`: the request body and the op's result.

Request: `ForwardBackwardRequest` (possibly zstd-compressed). Numeric loss_fn_config values
arrive twice (legacy `loss_fn_config` map and `loss_fn_config_v2`); v2 wins, and string
values exist only there. Tensors may be dense or CSR, 1-D or 2-D.

Result: `ForwardBackwardOutput`, whose per-datum tensors are batched per field: all datums'
values concatenated, int64 byte offsets (num_datums + 1), and the shape minus its first
dimension in `trailing_shape` (readers infer the first). Datums whose fields differ in dtype
or trailing shape go into separate `ArrayRecord`s, which readers concatenate.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import zstandard
from google.protobuf.message import DecodeError
from pydantic import ValidationError

from treadle.proto import treadle_wire_pb2 as pb
from treadle.types.datum import Datum, PromptProvenanceSpan, SampledProvenanceSpan
from treadle.types.model_input import (
    DmelChunk,
    EncodedTextChunk,
    ImageAssetPointerChunk,
    ImageChunk,
    ModelInput,
    ModelInputChunk,
)
from treadle.types.tensor import TensorData, TensorDtype
from treadle.types.training import ForwardBackwardOutput, ForwardBackwardRequest
from treadle.wire._codec import (
    DEFAULT_MAX_BODY_BYTES,
    FLOAT32,
    INT32,
    INT64,
    WRITE_DTYPES,
    WireFormatError,
    decompress_body,
    first_error,
    pack,
    read_dtype,
    tensor_from_proto,
    tensor_to_proto,
    unpack,
    unpack_values,
)

T = TypeVar("T")

_SEND_PROTOBUF = (
    "send a serialized ForwardBackwardRequest protobuf (tinker_public / treadle.wire.v1 "
    "schema) with Content-Type: application/x-protobuf"
)

# ---- request ------------------------------------------------------------------------------


def decode_forward_backward_request(
    body: bytes,
    content_encoding: str | None = None,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> ForwardBackwardRequest:
    """Decode a `/forward_backward` body (plain, zstd or gzip).

    Raises:
        WireFormatError: the body is compressed wrongly, is not a ForwardBackwardRequest, or
            holds a malformed datum; the message names the offending part.
    """
    msg = parse_forward_backward_request(body, content_encoding, max_body_bytes=max_body_bytes)
    data = [_datum_from_proto(d, f"data[{i}]") for i, d in enumerate(msg.data)]
    return ForwardBackwardRequest(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        data=data,
        loss_fn=msg.loss_fn,
        loss_fn_config=loss_config_from_proto(msg),
        forward_only=msg.forward_only,
    )


def parse_forward_backward_request(
    body: bytes,
    content_encoding: str | None = None,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> pb.ForwardBackwardRequest:
    """The body's protobuf message, its datums left as sent (no per-value Python objects).

    A server that reads tensors with numpy starts here; `decode_forward_backward_request`
    goes on to build `treadle.types`.

    Raises:
        WireFormatError: the body is compressed wrongly, is JSON, is not a protobuf message,
            or has no model_id.
    """
    raw = decompress_body(body, content_encoding, max_body_bytes)
    if raw.lstrip()[:1] in (b"{", b"["):
        raise WireFormatError(f"forward_backward does not take JSON; {_SEND_PROTOBUF}")
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except DecodeError as exc:
        raise WireFormatError(
            f"body is not a valid protobuf message ({exc}); {_SEND_PROTOBUF}"
        ) from exc
    if not msg.model_id:
        raise WireFormatError(f"ForwardBackwardRequest has no model_id; {_SEND_PROTOBUF}")
    return msg


def encode_forward_backward_request(
    request: ForwardBackwardRequest, *, compress: bool = False
) -> bytes:
    """Serialize a request the way the tinker SDK does (optionally zstd-compressed).

    Raises:
        ValueError: a chunk cannot travel in protobuf (image_asset_pointer) or a value does
            not fit its wire type.
    """
    msg = pb.ForwardBackwardRequest(
        model_id=request.model_id,
        seq_id=request.seq_id,
        loss_fn=request.loss_fn,
        forward_only=request.forward_only,
    )
    for key, value in (request.loss_fn_config or {}).items():
        if isinstance(value, str):
            msg.loss_fn_config_v2[key].text = value
        else:  # mirrored into the legacy map for servers that predate v2
            msg.loss_fn_config[key] = float(value)
            msg.loss_fn_config_v2[key].number = float(value)
    for i, datum in enumerate(request.data):
        _datum_to_proto(datum, msg.data.add(), f"data[{i}]")
    body = msg.SerializeToString()
    return zstandard.ZstdCompressor().compress(body) if compress else body


def loss_config_from_proto(msg: pb.ForwardBackwardRequest) -> dict[str, float | str] | None:
    """The request's loss_fn_config: the legacy numeric map overlaid by v2 (v2 wins)."""
    config: dict[str, float | str] = dict(msg.loss_fn_config.items())
    for key, value in msg.loss_fn_config_v2.items():
        which = value.WhichOneof("value")
        if which == "number":
            config[key] = value.number
        elif which == "text":
            config[key] = value.text
        else:
            raise WireFormatError(
                f"loss_fn_config_v2[{key!r}] has neither number nor text; set one of them"
            )
    return config or None


def _datum_from_proto(msg: pb.Datum, where: str) -> Datum:
    chunks = [
        chunk_from_proto(c, f"{where}.model_input[{j}]") for j, c in enumerate(msg.model_input)
    ]
    inputs = {
        name: tensor_from_proto(tensor, f"{where}.loss_fn_inputs[{name!r}]")
        for name, tensor in msg.loss_fn_inputs.items()
    }
    try:
        return Datum(
            model_input=ModelInput(chunks=chunks),
            loss_fn_inputs=inputs,
            model_input_spans=spans_from_proto(msg.model_input_spans),
            loss_fn_input_spans=spans_from_proto(msg.loss_fn_input_spans),
        )
    except ValidationError as exc:
        raise WireFormatError(f"{where}: {first_error(exc)}") from exc


def chunk_from_proto(msg: pb.Chunk, where: str) -> ModelInputChunk:
    """One model-input chunk as `treadle.types` (token chunks become lists: read those from
    their bytes where that matters)."""
    which = msg.WhichOneof("chunk")
    if which == "encoded_text":
        return EncodedTextChunk(tokens=unpack(msg.encoded_text.tokens, INT32, f"{where} tokens"))
    if which == "image":
        image = msg.image
        if image.format not in ("png", "jpeg"):
            raise WireFormatError(f"{where} has image format {image.format!r}; send png or jpeg")
        if image.HasField("override_dimensions"):
            raise WireFormatError(
                f"{where} sets override_dimensions, which this server does not support; "
                "resize the image client-side instead"
            )
        expected = image.expected_tokens if image.HasField("expected_tokens") else None
        return ImageChunk(data=image.data, format=image.format, expected_tokens=expected)  # type: ignore[arg-type]
    if which == "dmel":
        return DmelChunk(dmel=msg.dmel.dmel)
    raise WireFormatError(f"{where} is an empty chunk; set encoded_text, image or dmel")


def spans_from_proto(
    spans: Any,
) -> list[PromptProvenanceSpan | SampledProvenanceSpan] | None:
    """A datum's provenance spans; raises pydantic's ValidationError for a span out of bounds."""
    if not spans:
        return None
    out: list[PromptProvenanceSpan | SampledProvenanceSpan] = []
    for span in spans:
        which = span.WhichOneof("span")
        if which == "prompt_tokens":
            p = span.prompt_tokens
            out.append(
                PromptProvenanceSpan(sequence_id=p.sequence_id, offset=p.offset, length=p.length)
            )
        elif which == "sampled_tokens":
            s = span.sampled_tokens
            out.append(
                SampledProvenanceSpan(sequence_id=s.sequence_id, offset=s.offset, length=s.length)
            )
        else:
            raise WireFormatError("a provenance span sets neither prompt_tokens nor sampled_tokens")
    return out


def _datum_to_proto(datum: Datum, msg: pb.Datum, where: str) -> None:
    for chunk in datum.model_input.chunks:
        out = msg.model_input.add()
        if isinstance(chunk, EncodedTextChunk):
            out.encoded_text.tokens = pack(chunk.tokens, INT32, f"{where} tokens")
        elif isinstance(chunk, ImageChunk):
            out.image.data = chunk.data
            out.image.format = chunk.format
            if chunk.expected_tokens is not None:
                out.image.expected_tokens = chunk.expected_tokens
        elif isinstance(chunk, DmelChunk):
            out.dmel.dmel = chunk.dmel
        elif isinstance(chunk, ImageAssetPointerChunk):
            raise ValueError(
                f"{where}: image_asset_pointer chunks cannot be sent to forward_backward; "
                "send the image bytes in an image chunk"
            )
    for name, tensor in datum.loss_fn_inputs.items():
        tensor_to_proto(tensor, msg.loss_fn_inputs[name], f"{where}.loss_fn_inputs[{name!r}]")
    for spans, field in (
        (datum.model_input_spans, msg.model_input_spans),
        (datum.loss_fn_input_spans, msg.loss_fn_input_spans),
    ):
        for span in spans or []:
            arm = field.add()
            target = arm.prompt_tokens if span.type == "prompt_tokens" else arm.sampled_tokens
            target.sequence_id = span.sequence_id
            target.offset = span.offset
            target.length = span.length


# ---- result -------------------------------------------------------------------------------


def encode_forward_backward_output(output: ForwardBackwardOutput) -> bytes:
    """Serialize a result so the tinker SDK decodes it into the same per-datum tensors.

    CSR tensors are sent dense (pad 0). A 0-d tensor reads back with shape [1].

    Raises:
        ValueError: datums disagree on their output field names.
    """
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=output.loss_fn_output_type)
    msg.metrics.update(output.metrics)
    outputs = output.loss_fn_outputs
    names = output_field_names(outputs)
    for start, end in record_runs(outputs, _layout):
        _add_record(msg, output.loss_fn_output_type, outputs[start:end], names)
    return msg.SerializeToString()


def output_field_names(outputs: Sequence[Mapping[str, object]]) -> list[str]:
    """The fields every datum's output reports (the same for all of them).

    Raises:
        ValueError: datums disagree on their output field names.
    """
    names = sorted(outputs[0]) if outputs else []
    for i, fields in enumerate(outputs):
        if sorted(fields) != names:
            raise ValueError(
                f"loss_fn_outputs[{i}] has fields {sorted(fields)} but loss_fn_outputs[0] has "
                f"{names}; every datum must report the same fields"
            )
    return names


def record_runs(outputs: Sequence[T], layout: Callable[[T], object]) -> Iterator[tuple[int, int]]:
    """`(start, end)` of each run of consecutive datums sharing each field's dtype and trailing
    shape (`layout`): each run travels as one record."""
    start = 0
    while start < len(outputs):
        first = layout(outputs[start])
        end = start + 1
        while end < len(outputs) and layout(outputs[end]) == first:
            end += 1
        yield start, end
        start = end


def _layout(fields: dict[str, TensorData]) -> list[tuple[str, TensorDtype, list[int]]]:
    return [(name, t.dtype, t.dense_shape[1:]) for name, t in sorted(fields.items())]


def _add_record(
    msg: pb.ForwardBackwardOutput,
    type_tag: str,
    datums: list[dict[str, TensorData]],
    names: list[str],
) -> None:
    record = msg.loss_fn_outputs.add(type_tag=type_tag, num_datums=len(datums))
    for name in names:
        first = datums[0][name]
        kind = FLOAT32 if first.dtype == "float32" else INT64
        parts = [pack(d[name].dense_values(), kind, f"output {name!r}") for d in datums]
        offsets = [0]
        for part in parts:
            offsets.append(offsets[-1] + len(part))
        batched = record.fields[name]
        batched.data = b"".join(parts)
        batched.offsets = pack(offsets, INT64, "offsets")
        batched.dtype = WRITE_DTYPES[first.dtype]
        batched.trailing_shape.extend(first.dense_shape[1:])


def decode_forward_backward_output(body: bytes) -> ForwardBackwardOutput:
    """Decode a result as the tinker SDK does (int32 widens to int64, bf16 to float32).

    Raises:
        WireFormatError: the bytes are not a consistent ForwardBackwardOutput.
    """
    msg = pb.ForwardBackwardOutput()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise WireFormatError(f"not a ForwardBackwardOutput protobuf ({exc})") from exc
    per_field: dict[str, list[TensorData]] = {}
    num_datums = 0
    for r, record in enumerate(msg.loss_fn_outputs):
        count = record.num_datums
        for name, batched in record.fields.items():
            tensors = _split_batched(batched, f"loss_fn_outputs[{r}].fields[{name!r}]")
            if count and len(tensors) != count:
                raise WireFormatError(
                    f"loss_fn_outputs[{r}] says num_datums={count} but field {name!r} "
                    f"holds {len(tensors)} datums"
                )
            count = count or len(tensors)
            per_field.setdefault(name, []).extend(tensors)
        num_datums += count
    for name, tensors in per_field.items():
        if len(tensors) != num_datums:
            raise WireFormatError(f"field {name!r} covers {len(tensors)} of {num_datums} datums")
    outputs = [{name: tensors[i] for name, tensors in per_field.items()} for i in range(num_datums)]
    loss_type = msg.loss_fn_output_type.rsplit(":", 1)[-1] or "ArrayRecord"
    return ForwardBackwardOutput.model_construct(
        loss_fn_output_type=loss_type, loss_fn_outputs=outputs, metrics=dict(msg.metrics)
    )


def _split_batched(batched: pb.BatchedTensor, what: str) -> list[TensorData]:
    dtype, wire_dtype = read_dtype(batched.dtype, what)
    itemsize = {"float32": 4, "int64": 8, "int32": 4, "bfloat16": 2}[wire_dtype]
    values = unpack_values(batched.data, wire_dtype, what)
    offsets = unpack(batched.offsets, INT64, f"{what} offsets")
    trailing = list(batched.trailing_shape)
    per_row = math.prod(trailing)
    out: list[TensorData] = []
    for lo, hi in itertools.pairwise(offsets):
        if lo % itemsize or hi % itemsize or not 0 <= lo <= hi <= len(batched.data):
            raise WireFormatError(f"{what} has byte offsets {lo}..{hi} outside its data")
        chunk = values[lo // itemsize : hi // itemsize]
        leading = len(chunk) // per_row if per_row else 0
        if leading * per_row != len(chunk):
            raise WireFormatError(
                f"{what}: {len(chunk)} values do not fill rows of trailing shape {trailing}"
            )
        out.append(
            TensorData.model_construct(
                data=chunk,
                dtype=dtype,
                shape=[leading, *trailing],
                sparse_crow_indices=None,
                sparse_col_indices=None,
            )
        )
    return out
