"""Wire types shared by the treadle client and the Treadle server."""

from treadle.types.session import (
    ClientConfigRequest,
    ClientConfigResponse,
    ClientDynamicConfigResponse,
    CreateSessionRequest,
    CreateSessionResponse,
    FinishReason,
    FinishSessionRequest,
    FinishSessionResponse,
    HealthResponse,
    ServerCapabilities,
    SessionHeartbeatRequest,
    SessionHeartbeatResponse,
    SupportedModel,
    TelemetryResponse,
)

__all__ = [
    "ClientConfigRequest",
    "ClientConfigResponse",
    "ClientDynamicConfigResponse",
    "CreateSessionRequest",
    "CreateSessionResponse",
    "FinishReason",
    "FinishSessionRequest",
    "FinishSessionResponse",
    "HealthResponse",
    "ServerCapabilities",
    "SessionHeartbeatRequest",
    "SessionHeartbeatResponse",
    "SupportedModel",
    "TelemetryResponse",
]
