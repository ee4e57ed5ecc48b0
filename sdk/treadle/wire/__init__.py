"""Conversions between Treadle's protobuf messages and `treadle.types`.

Three bodies of the Tinker protocol are protobuf: the `/forward_backward` request, and the
forward_backward and sample results returned by `/retrieve_future`. The server decodes the
first and encodes the others; Treadle's own client does the reverse. Byte layouts follow the
tinker SDK 0.38.0 exactly (see spec/tinker-wire.md §2.4).

This package knows the wire format only: it does not check that a loss function exists,
that tensors match the model input, or anything else a server decides.
"""

from treadle.wire._codec import (
    DEFAULT_MAX_BODY_BYTES,
    PROTOBUF_CONTENT_TYPE,
    BodyTooLarge,
    WireFormatError,
    decompress_body,
)
from treadle.wire.forward_backward import (
    decode_forward_backward_output,
    decode_forward_backward_request,
    encode_forward_backward_output,
    encode_forward_backward_request,
    output_field_names,
    parse_forward_backward_request,
    record_runs,
)
from treadle.wire.sample import decode_sample_response, encode_sample_response

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "PROTOBUF_CONTENT_TYPE",
    "BodyTooLarge",
    "WireFormatError",
    "decode_forward_backward_output",
    "decode_forward_backward_request",
    "decode_sample_response",
    "decompress_body",
    "encode_forward_backward_output",
    "encode_forward_backward_request",
    "encode_sample_response",
    "output_field_names",
    "parse_forward_backward_request",
    "record_runs",
]
