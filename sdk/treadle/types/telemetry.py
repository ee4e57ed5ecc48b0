"""Client telemetry batches (`/telemetry`). A server may accept and discard them.

The tinker SDK sends four event shapes without a discriminator besides `event`; they are
folded into one lenient model here (unknown event fields are ignored, as the SDK's own event
models do).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, TypeAlias

from treadle.types._base import WireRequest, WireResponse

TelemetryEventType: TypeAlias = Literal[
    "SESSION_START", "SESSION_END", "UNHANDLED_EXCEPTION", "GENERIC_EVENT"
]
Severity: TypeAlias = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


class TelemetryEvent(WireResponse):
    event: TelemetryEventType
    event_id: str
    event_session_index: int
    severity: Severity
    timestamp: datetime
    event_name: str | None = None
    event_data: dict[str, Any] | None = None
    error_message: str | None = None
    error_type: str | None = None
    traceback: str | None = None
    duration: str | None = None
    """SESSION_END only: ISO 8601 duration."""


class TelemetrySendRequest(WireRequest):
    events: list[TelemetryEvent]
    platform: str
    sdk_version: str
    session_id: str
    """A session id, or `sessionless-<uuid>` for clients without one."""
    process_uuid: str
