"""Client bootstrap endpoints: configuration flags, telemetry, capabilities, health."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request, Response

from api.deps import CurrentPrincipal, State
from api.jsonbody import MAX_JSON_DEPTH, nesting_exceeds
from api.openapi import error_responses, raw_request_body
from core.errors import InvalidInput, PayloadTooLarge
from scheduler.served import registered_models
from treadle.types import (
    ClientConfigRequest,
    ClientConfigResponse,
    ClientDynamicConfigResponse,
    HealthResponse,
    ReadinessResponse,
    ServerCapabilities,
    SupportedModel,
    TelemetryResponse,
)

router = APIRouter(prefix="/api/v1", tags=["client"])

_JSON_KINDS = {
    list: "a JSON array",
    str: "a JSON string",
    bool: "a JSON boolean",
    int: "a JSON number",
    float: "a JSON number",
    type(None): "JSON null",
}


@router.post(
    "/client/config",
    response_model=ClientConfigResponse,
    response_model_exclude_none=True,
    responses=error_responses(413, 422),
)
def client_config(_: ClientConfigRequest, state: State) -> ClientConfigResponse:
    # Plain httpx keeps one HTTP stack on both sides. A 402 (spend limit reached) pauses the
    # SDK's work for up to the pause given here, so a raised limit lets it go on.
    return ClientConfigResponse(
        use_pyqwest_transport=False,
        fwdbwd_max_chunk_len=state.settings.fwdbwd_max_chunk_len,
        billing_exception_max_pause_duration_sec=state.settings.spend_limit_pause_seconds,
    )


@router.post(
    "/client/dynamic_config",
    response_model=ClientDynamicConfigResponse,
    response_model_exclude_none=True,
    responses=error_responses(413, 422),
)
def client_dynamic_config(_: ClientConfigRequest) -> ClientDynamicConfigResponse:
    return ClientDynamicConfigResponse()


@router.post(
    "/telemetry",
    response_model=TelemetryResponse,
    responses=error_responses(401, 403, 413, 422, 429),
    openapi_extra=raw_request_body(
        json_schema={"type": "object"},
        required=False,
        description="A batch of client telemetry events (the tinker SDK's TelemetrySendRequest).",
    ),
)
async def telemetry(
    request: Request, principal: CurrentPrincipal, state: State
) -> TelemetryResponse:
    """Accepted and dropped: Treadle keeps no client telemetry. Rate-limited per API key."""
    state.telemetry_limiter.take(principal.key_id, "telemetry")
    body = await request.body()
    if len(body) > state.settings.telemetry_max_bytes:
        raise PayloadTooLarge(
            f"telemetry batch of {len(body)} bytes exceeds {state.settings.telemetry_max_bytes}; "
            "send smaller batches"
        )
    if nesting_exceeds(body):  # this route reads any content type, not only JSON
        raise InvalidInput(
            f"telemetry body nests more than {MAX_JSON_DEPTH} levels deep; send flatter events"
        )
    try:
        batch = json.loads(body or b"{}")
    except ValueError as exc:
        raise InvalidInput(f"telemetry body is not JSON ({exc}); send a JSON object") from exc
    if not isinstance(batch, dict):
        raise InvalidInput(
            f"telemetry body is {_JSON_KINDS[type(batch)]}; send a JSON object of events"
        )
    return TelemetryResponse()


@router.get(
    "/get_server_capabilities",
    response_model=ServerCapabilities,
    response_model_exclude_none=True,
    responses=error_responses(401, 403),
)
def get_server_capabilities(_: CurrentPrincipal, state: State) -> ServerCapabilities:
    """The offered base models; context lengths once a worker serving them has registered."""
    with state.database.reader() as db:
        registered = registered_models(db)
    aliases = state.settings.model_aliases
    return ServerCapabilities(
        supported_models=[
            SupportedModel(
                model_name=name,
                max_context_length=registered.get(aliases.get(name, name), {}).get(
                    "max_context_length"
                ),
            )
            for name in state.settings.offered_models
        ]
    )


@router.get("/healthz", response_model=HealthResponse)
def healthz() -> HealthResponse:
    return HealthResponse()


@router.get(
    "/readyz",
    response_model=ReadinessResponse,
    responses={
        503: {
            "model": ReadinessResponse,
            "description": "Not ready: a check failed (`checks` says which and why), or none "
            "has finished recently.",
        }
    },
)
def readyz(response: Response, state: State) -> ReadinessResponse:
    """Readiness for load balancers, from the last background check (`api.readiness`): cheap
    enough to probe every second. Liveness stays with `/healthz`."""
    report = state.readiness.report()
    if not report.ready:
        response.status_code = 503
    return ReadinessResponse(status="ready" if report.ready else "not ready", checks=report.checks)
