"""Training runs as the REST API lists them (tinker's `RestClient.list/get_training_run`).

Run ids contain ':' but never '/', so the plain path parameter matches them and leaves
`/training_runs/{run_id}/checkpoints...` to the checkpoints router. A foreign run answers 404
exactly like a missing one, unless `access_scope=accessible` and it has a published checkpoint.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query
from sqlalchemy.orm import Session as OrmSession

from api.deps import CurrentPrincipal, ReadSession, State
from api.openapi import error_responses
from api.views import checkpoint_view, string_metadata
from core import checkpoints, runs
from core.clock import Clock
from core.errors import NotFound
from core.tables import TrainingRun as RunRow
from treadle.types import Checkpoint, Cursor, TrainingRun, TrainingRunsResponse
from treadle.types.bounds import MAX_OFFSET

router = APIRouter(prefix="/api/v1", tags=["training runs"])

AccessScope = Literal["owned", "accessible"]


@router.get(
    "/training_runs",
    response_model=TrainingRunsResponse,
    responses=error_responses(401, 403, 422),
)
def list_training_runs(
    principal: CurrentPrincipal,
    db: ReadSession,
    state: State,
    limit: int = Query(20, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=MAX_OFFSET),
    access_scope: AccessScope = "owned",
    project_id: str | None = None,
) -> TrainingRunsResponse:
    """The caller's own runs, newest first (listings never include other tenants' runs)."""
    rows, total = runs.list_runs(db, principal.tenant_id, limit=limit, offset=offset)
    return TrainingRunsResponse(
        training_runs=[_run_view(db, state.clock, row, principal.tenant_id) for row in rows],
        cursor=Cursor(offset=offset, limit=limit, total_count=total),
    )


@router.get(
    "/training_runs/{run_id}",
    response_model=TrainingRun,
    responses=error_responses(401, 403, 404, 422),
)
def get_training_run(
    run_id: str,
    principal: CurrentPrincipal,
    db: ReadSession,
    state: State,
    access_scope: AccessScope = "owned",
) -> TrainingRun:
    try:
        row = runs.get_run(db, principal.tenant_id, run_id)
    except NotFound:
        foreign = db.get(RunRow, run_id)
        if (
            access_scope != "accessible"
            or foreign is None
            or not checkpoints.has_public(db, state.clock, run_id)
        ):
            raise
        row = foreign
    return _run_view(db, state.clock, row, principal.tenant_id)


def _run_view(db: OrmSession, clock: Clock, run: RunRow, viewer: str) -> TrainingRun:
    def latest(kind: str) -> Checkpoint | None:
        version = checkpoints.latest_of_kind(db, run.id, kind)
        if version is None or not checkpoints.live(version, clock):
            return None
        if run.tenant_id != viewer and not version.public:
            return None
        return checkpoint_view(version)

    return TrainingRun(
        training_run_id=run.id,
        base_model=run.base_model,
        model_owner=run.tenant_id,
        is_lora=True,
        corrupted=run.corrupted,
        lora_rank=run.lora_rank,
        last_request_time=run.last_request_at,
        last_checkpoint=latest("training"),
        last_sampler_checkpoint=latest("sampler"),
        user_metadata=string_metadata(run.user_metadata),
    )
