"""Futures: how asynchronous ops are submitted, polled and resolved.

Every op answers its submission with an `UntypedAPIFuture` at once. The client then polls
`/retrieve_future`, which the server long-polls; the reply is one of:

* the result itself (JSON, or protobuf for forward_backward and sample results),
* `TryAgainResponse` (still pending; `queue_state` says why),
* `CompleteMetadataResponse` (result ready; only its size, when the client allowed that),
* `FutureError` (the op failed; `category` says whose fault, `code` what kind of failure).

A result must therefore never contain the keys `error`, `type: "try_again"` or
`status: "complete_metadata"`.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeAlias

from pydantic import Field

from treadle.types._base import WireRequest, WireResponse
from treadle.types.bounds import Cursor64, ServerId

QueueState: TypeAlias = Literal["active", "paused_capacity", "paused_rate_limit"]
ErrorCategory: TypeAlias = Literal["user", "server", "unknown"]


class UntypedAPIFuture(WireResponse):
    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None
    """Sample submissions only, and required there: one id per returned sequence."""


class RetrieveFutureRequest(WireRequest):
    request_id: ServerId
    allow_metadata_only: bool = False


class TryAgainResponse(WireResponse):
    request_id: str
    queue_state: QueueState = "active"
    queue_state_reason: str | None = None
    type: Literal["try_again"] = "try_again"


class CompleteMetadataResponse(WireResponse):
    response_payload_size: int
    status: Literal["complete_metadata"] = "complete_metadata"


class FutureError(WireResponse):
    """A failed op. `user` errors say what to change; the run stays usable either way."""

    error: str
    category: ErrorCategory = "unknown"
    code: str | None = None
    """One of `ErrorCode`'s values; absent from older servers, and a newer server may send a
    value this client does not know (kept as text, not refused)."""


class CancelFutureRequest(WireRequest):
    request_id: ServerId


class SamplingSessionFuturesTarget(WireRequest):
    sampling_session_id: ServerId
    cloned_sampler_id: Cursor64 = 0
    """`seq_id // 1_000_000_000` of the polling client (0 for the original)."""
    type: Literal["sampling_session"] = "sampling_session"


class RetrieveFuturesRequest(WireRequest):
    """Session-wide poll (`/retrieve_futures`); `timeout` 0 acknowledges without waiting."""

    target: SamplingSessionFuturesTarget
    prev_cursor: Cursor64 = 0
    timeout: float | None = None
    retrieved_request_ids: list[str] = Field(default_factory=list)


class FutureFinished(WireResponse):
    request_id: str
    response_payload_uncompressed_size: int | None = None
    state: Literal["finished"] = "finished"


class FutureFailed(WireResponse):
    request_id: str
    state: Literal["failed"] = "failed"


FutureCompletion: TypeAlias = Annotated[FutureFinished | FutureFailed, Field(discriminator="state")]


class RetrieveFuturesResponse(WireResponse):
    completions: list[FutureCompletion]
    cursor: int
