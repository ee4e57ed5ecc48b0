"""Wire types for the client configuration and session lifecycle endpoints."""

from typing import Any, Literal

from pydantic import Field, SerializationInfo, SerializerFunctionWrapHandler, model_serializer

from treadle.types._base import WireRequest, WireResponse


class ClientConfigRequest(WireRequest):
    sdk_version: str | None = None


class ClientConfigResponse(WireResponse):
    """Server-driven client flags (the tinker SDK reads these at start-up).

    Fields left at None are omitted from the JSON, so the client keeps its own default.
    """

    pjwt_auth_enabled: bool | None = None
    use_pyqwest_transport: bool | None = None
    parallel_fwdbwd_chunks: bool | None = None
    fwdbwd_max_chunk_len: int | None = None
    fwdbwd_max_chunk_bytes_count: int | None = None
    proto_compress_fwdbwd: bool | None = None
    sample_max_concurrent_requests: int | None = None
    sample_use_retrieve_futures: bool | None = None
    sample_join_sampling_session: bool | None = None
    custom_loss_server_side: bool | None = None
    billing_exception_max_pause_duration_sec: float | None = None
    credential_default_source: str | None = None
    sample_dispatch_bytes_semaphore_size: int | None = None
    inflight_response_bytes_semaphore_size: int | None = None
    fwdbwd_dispatch_bytes_semaphore_size: int | None = None
    sample_no_retries: bool | None = None
    sample_enable_stuck_detection: bool | None = None

    @model_serializer(mode="wrap")
    def _omit_unset_flags(
        self, handler: SerializerFunctionWrapHandler, info: SerializationInfo
    ) -> dict[str, Any]:
        return _without_none(handler(self))


class ClientDynamicConfigResponse(WireResponse):
    refresh_interval_sec: float | None = None
    sample_cancel_enabled: bool | None = None
    sample_cancel_max_batch_size: int | None = None

    @model_serializer(mode="wrap")
    def _omit_unset_flags(
        self, handler: SerializerFunctionWrapHandler, info: SerializationInfo
    ) -> dict[str, Any]:
        return _without_none(handler(self))


def _without_none(data: dict[str, Any]) -> dict[str, Any]:
    # The tinker SDK declares these flags as non-nullable with defaults: an explicit null
    # fails its strict validation, so unset flags must be left out of the JSON entirely.
    return {key: value for key, value in data.items() if value is not None}


class CreateSessionRequest(WireRequest):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None
    type: Literal["create_session"] = "create_session"


class CreateSessionResponse(WireResponse):
    session_id: str
    type: Literal["create_session"] = "create_session"
    info_message: str | None = None
    warning_message: str | None = None
    error_message: str | None = None


class SessionHeartbeatRequest(WireRequest):
    session_id: str
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


class AssignSessionProjectRequest(WireRequest):
    project_id: str


class SessionTraceExportResponse(WireResponse):
    status: Literal["pending", "ready", "failed"]
    url: str | None = None
    """Set when ready."""
    error: str | None = None
    """Set when failed."""
