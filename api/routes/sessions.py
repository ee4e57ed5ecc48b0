"""Session lifecycle endpoints of the Tinker protocol, plus session listing."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query

from api.deps import CurrentPrincipal, DbSession, ReadSession, State
from api.openapi import error_responses
from api.views import string_metadata
from core import sessions
from treadle.types import (
    CreateSessionRequest,
    CreateSessionResponse,
    FinishSessionRequest,
    FinishSessionResponse,
    ListSessionsResponse,
    SessionHeartbeatRequest,
    SessionHeartbeatResponse,
    SessionInfo,
)
from treadle.types.bounds import MAX_OFFSET

router = APIRouter(prefix="/api/v1", tags=["sessions"])


@router.post(
    "/create_session",
    response_model=CreateSessionResponse,
    response_model_exclude_none=True,
    responses=error_responses(401, 403, 413, 422),
)
def create_session(
    body: CreateSessionRequest, principal: CurrentPrincipal, state: State
) -> CreateSessionResponse:
    with state.database.transaction() as db:
        session = sessions.create_session(
            db,
            state.clock,
            tenant_id=principal.tenant_id,
            api_key_id=principal.key_id,
            ttl_seconds=state.settings.session_ttl_seconds,
            tags=body.tags,
            user_metadata=body.user_metadata,
            sdk_version=body.sdk_version,
            project_id=body.project_id,
            display_name=body.display_name,
        )
    return CreateSessionResponse(session_id=session.id)


@router.post(
    "/session_heartbeat",
    response_model=SessionHeartbeatResponse,
    responses=error_responses(401, 403, 404, 410, 413, 422),
)
def session_heartbeat(
    body: SessionHeartbeatRequest, principal: CurrentPrincipal, state: State
) -> SessionHeartbeatResponse:
    with state.database.transaction() as db:
        session = sessions.heartbeat(
            db,
            state.clock,
            tenant_id=principal.tenant_id,
            session_id=body.session_id,
            ttl_seconds=state.settings.session_ttl_seconds,
        )
    sessions.require_open(session)  # once committed: an expiry found here is kept
    return SessionHeartbeatResponse()


@router.post(
    "/sessions/{session_id}/finish",
    response_model=FinishSessionResponse,
    responses=error_responses(401, 403, 404, 413, 422),
)
def finish_session(
    session_id: str, body: FinishSessionRequest, principal: CurrentPrincipal, state: State
) -> FinishSessionResponse:
    with state.database.transaction() as db:
        session = sessions.finish(
            db,
            state.clock,
            tenant_id=principal.tenant_id,
            session_id=session_id,
            reason=body.reason.type,
            detail=body.detail,
            ttl_seconds=state.settings.session_ttl_seconds,
        )
        return FinishSessionResponse(session_id=session.id, status=session.status)


@router.get(
    "/sessions",
    response_model=ListSessionsResponse,
    responses=error_responses(401, 403, 422),
)
def list_sessions(
    principal: CurrentPrincipal,
    db: ReadSession,
    state: State,
    limit: int = Query(20, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=MAX_OFFSET),
    access_scope: str | None = None,
    status: Literal["open"] | None = Query(
        None, description="`open`: only sessions still active (a Treadle extension)."
    ),
) -> ListSessionsResponse:
    rows = sessions.list_sessions(
        db,
        tenant_id=principal.tenant_id,
        limit=limit,
        offset=offset,
        open_within=(
            (state.clock, state.settings.session_ttl_seconds) if status == "open" else None
        ),
    )
    return ListSessionsResponse(sessions=[row.id for row in rows])


@router.get(
    "/sessions/{session_id}",
    response_model=SessionInfo,
    responses=error_responses(401, 403, 404),
)
def get_session(
    session_id: str,
    principal: CurrentPrincipal,
    db: DbSession,
    state: State,
    access_scope: str | None = None,
) -> SessionInfo:
    session = sessions.get_session(
        db,
        state.clock,
        tenant_id=principal.tenant_id,
        session_id=session_id,
        ttl_seconds=state.settings.session_ttl_seconds,
    )
    run_ids, sampler_ids = sessions.children(db, session.id)
    return SessionInfo(
        session_id=session.id,
        status=session.status,
        created_at=session.created_at,
        last_heartbeat_at=session.last_heartbeat_at,
        ended_at=session.ended_at,
        end_reason=session.end_reason,
        training_run_ids=run_ids,
        sampler_ids=sampler_ids,
        user_metadata=string_metadata(session.user_metadata),
        display_name=session.display_name,
        tags=session.tags,
    )
