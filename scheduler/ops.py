"""Operation kinds and how their payloads and results are stored.

Payloads are stored once, compressed: forward_backward keeps the client's protobuf body as
sent (it is decoded again where it executes), everything else is JSON. Results of
forward_backward and sample are protobuf (what the tinker SDK requires); the rest JSON.
"""

from __future__ import annotations

import enum
import json
import threading
from typing import Any

import zstandard

from core.errors import ErrorCode
from scheduler.failures import OpFailure


class _Codecs(threading.local):
    """A zstd compressor and decompressor per thread: their objects must never be shared
    between threads (concurrent use crashes the process), and requests run on many."""

    def __init__(self) -> None:
        self.compressor = zstandard.ZstdCompressor(level=3)
        self.decompressor = zstandard.ZstdDecompressor()


_codecs = _Codecs()


class OpKind(enum.StrEnum):
    CREATE_MODEL = "create_model"
    LOAD_WEIGHTS = "load_weights"
    FORWARD_BACKWARD = "forward_backward"
    OPTIM_STEP = "optim_step"
    SAVE_WEIGHTS = "save_weights"
    SAVE_WEIGHTS_FOR_SAMPLER = "save_weights_for_sampler"
    SAVE_WEIGHTS_EXTERNAL = "save_weights_external"
    UNLOAD_MODEL = "unload_model"
    SAMPLE = "sample"


PROTO, JSON = "proto", "json"
PROTO_ZSTD, JSON_ZSTD = "proto+zstd", "json+zstd"


def encode_json_payload(payload: dict[str, Any]) -> tuple[bytes, str]:
    return _codecs.compressor.compress(
        json.dumps(payload, separators=(",", ":")).encode()
    ), JSON_ZSTD


def encode_proto_payload(body: bytes) -> tuple[bytes, str]:
    return _codecs.compressor.compress(body), PROTO_ZSTD


def decode_payload(data: bytes, codec: str) -> bytes:
    if codec not in (PROTO_ZSTD, JSON_ZSTD):
        raise ValueError(f"unknown payload codec {codec!r}")
    return _codecs.decompressor.decompress(data)


REFUSED, REFUSED_CODE = "refused", "refused_code"

STREAMED = "streamed"
"""Set to true in a sample op's JSON payload (never sent on the wire) when its requester reads
the tokens as they are chosen: the worker then publishes them (`Notifier.publish_progress`)."""


def refused(message: str, code: ErrorCode = ErrorCode.INVALID_INPUT) -> dict[str, Any]:
    """The payload of a request refused at submission: it fails, in order, with `message` and
    `code` (the code of the same refusal answered at once)."""
    return {REFUSED: message, REFUSED_CODE: code.value}


def decode_json_payload(data: bytes, codec: str) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(decode_payload(data, codec))
    return value


def refusal_of(data: bytes, codec: str) -> OpFailure | None:
    """How a request refused at submission fails; None for any other payload. Refusals stored
    without a code (before codes were stored) were invalid input."""
    if codec != JSON_ZSTD:
        return None
    payload = decode_json_payload(data, codec)
    message = payload.get(REFUSED)
    if message is None:
        return None
    code = payload.get(REFUSED_CODE)
    return OpFailure.stored(None if code is None else str(code), "user", str(message))
