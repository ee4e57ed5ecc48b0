"""Wire types for the client configuration and session lifecycle endpoints."""

from datetime import datetime
from typing import Any, Literal

from pydantic import Field

from treadle.types._base import WireRequest, WireResponse
from treadle.types.bounds import ServerId


class ClientConfigRequest(WireRequest):
    sdk_version: str | None = None


def _is_none(value: Any) -> bool:
    return value is None


# The tinker SDK declares these flags non-nullable with defaults, so an explicit null fails its
# strict validation: a flag left at None is dropped from the JSON however the model is dumped.
def _flag() -> Any:
    return Field(default=None, exclude_if=_is_none)


class ClientConfigResponse(WireResponse):
    """Server-driven client flags (the tinker SDK reads these at start-up).

    Fields left at None are omitted from the JSON, so the client keeps its own default.
    """

    pjwt_auth_enabled: bool | None = _flag()
    use_pyqwest_transport: bool | None = _flag()
    parallel_fwdbwd_chunks: bool | None = _flag()
    fwdbwd_max_chunk_len: int | None = _flag()
    fwdbwd_max_chunk_bytes_count: int | None = _flag()
    proto_compress_fwdbwd: bool | None = _flag()
    sample_max_concurrent_requests: int | None = _flag()
    sample_use_retrieve_futures: bool | None = _flag()
    sample_join_sampling_session: bool | None = _flag()
    custom_loss_server_side: bool | None = _flag()
    billing_exception_max_pause_duration_sec: int | None = _flag()
    credential_default_source: str | None = _flag()
    sample_dispatch_bytes_semaphore_size: int | None = _flag()
    inflight_response_bytes_semaphore_size: int | None = _flag()
    fwdbwd_dispatch_bytes_semaphore_size: int | None = _flag()
    sample_no_retries: bool | None = _flag()
    sample_enable_stuck_detection: bool | None = _flag()


class ClientDynamicConfigResponse(WireResponse):
    refresh_interval_sec: float | None = _flag()
    sample_cancel_enabled: bool | None = _flag()
    sample_cancel_max_batch_size: int | None = _flag()


class CreateSessionRequest(WireRequest):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    # The lengths the server keeps.
    sdk_version: str | None = Field(default=None, max_length=64)
    project_id: str | None = Field(default=None, max_length=200)
    display_name: str | None = Field(default=None, max_length=200)
    type: Literal["create_session"] = "create_session"


class CreateSessionResponse(WireResponse):
    session_id: str
    type: Literal["create_session"] = "create_session"
    info_message: str | None = None
    warning_message: str | None = None
    error_message: str | None = None


class SessionHeartbeatRequest(WireRequest):
    session_id: ServerId
    type: Literal["session_heartbeat"] = "session_heartbeat"


class SessionHeartbeatResponse(WireResponse):
    type: Literal["session_heartbeat"] = "session_heartbeat"


class FinishReason(WireRequest):
    type: Literal["success", "errored", "interrupted"]


class FinishSessionRequest(WireRequest):
    reason: FinishReason
    detail: str | None = None


class FinishSessionResponse(WireResponse):
    session_id: str
    status: str


class TelemetryResponse(WireResponse):
    status: Literal["accepted"] = "accepted"


class SupportedModel(WireResponse):
    model_name: str
    max_context_length: int | None = None
    trainable: bool = True
    sampleable: bool = True


class ServerCapabilities(WireResponse):
    supported_models: list[SupportedModel]


class HealthResponse(WireResponse):
    status: Literal["ok"] = "ok"


class ReadinessResponse(WireResponse):
    """`/readyz`: whether the server can do its work, from its last background check."""

    status: Literal["ready", "not ready"]
    checks: dict[str, str] = Field(
        description="Each check (`database`, `migrations`, `redis` in distributed mode) and "
        "`ok`, or why it failed."
    )


class AuthTokenResponse(WireResponse):
    """`/auth/token`: a JWT with `exp` and `iat` claims, sent back as `X-API-Key`."""

    jwt: str


class ListSessionsResponse(WireResponse):
    sessions: list[str]


class GetSessionResponse(WireResponse):
    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None


class SessionInfo(GetSessionResponse):
    """One session as Treadle reports it: tinker's `GetSessionResponse` fields, plus its id,
    status (`active`, `finished` or `expired`), tags and times (UTC)."""

    session_id: str
    status: str
    tags: list[str] = Field(default_factory=list)
    created_at: datetime | None = None
    last_heartbeat_at: datetime | None = None
    ended_at: datetime | None = None
    end_reason: str | None = None


class AssignSessionProjectRequest(WireRequest):
    project_id: str


class SessionTraceExportResponse(WireResponse):
    status: Literal["pending", "ready", "failed"]
    url: str | None = None
    """Set when ready."""
    error: str | None = None
    """Set when failed."""
