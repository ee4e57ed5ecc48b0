"""Checkpoints of a tenant's training runs: listing, deleting, publishing, TTLs, downloads.

Checkpoint ids are `<weights|sampler_weights|external_weights>/<name>` and appear unencoded in
paths, so a checkpoint is addressed by two path parameters, its kind segment and its name: a
checkpoint named `publish` or `ttl` can still be deleted, a suffix route is never taken for part
of an id, and the OpenAPI document describes the paths clients really send. A foreign
checkpoint answers 404 exactly like a missing one.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import APIRouter, Query, Request
from fastapi import Path as PathParameter
from sqlalchemy.orm import Session as OrmSession

from api.deps import CurrentPrincipal, ReadSession, State
from api.openapi import error_responses
from api.views import checkpoint_view
from core import audit, checkpoints, runs, signing
from core.apikeys import Principal
from core.clock import Clock
from core.errors import NotFound
from core.tables import ModelPackage, ModelVersion
from treadle.types import (
    CheckpointsListResponse,
    Cursor,
    ExternalWeightsUrlsResponse,
    SetCheckpointTtlRequest,
    WeightsInfoRequest,
    WeightsInfoResponse,
)
from treadle.types.bounds import MAX_OFFSET

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/api/v1", tags=["checkpoints"])

# Long enough to fetch a large export, short enough that a leaked link soon stops working.
DOWNLOAD_URL_SECONDS = 3600


CHECKPOINT = "/training_runs/{run_id}/checkpoints/{kind}/{name}"
KindSegment = Annotated[
    Literal["weights", "sampler_weights", "external_weights"],
    PathParameter(description="The checkpoint id's first part: what kind of save made it."),
]
CheckpointName = Annotated[
    str, PathParameter(description="The checkpoint id's second part: the name it was saved under.")
]


def _audit(
    db: OrmSession, clock: Clock, principal: Principal, version: ModelVersion, action: str
) -> None:
    """Log a change to the checkpoint, in the transaction that makes it."""
    audit.record(
        db,
        clock,
        tenant_id=principal.tenant_id,
        actor=principal.key_id,
        action=action,
        target=version.tinker_path,
        detail={
            "model_id": version.training_run_id,
            "tinker_path": version.tinker_path,
            "version_id": version.id,
        },
    )


def _listing(
    rows: list[ModelVersion], total: int, limit: int, offset: int
) -> CheckpointsListResponse:
    return CheckpointsListResponse(
        checkpoints=[checkpoint_view(row) for row in rows],
        cursor=Cursor(offset=offset, limit=limit, total_count=total),
    )


@router.get(
    "/checkpoints",
    response_model=CheckpointsListResponse,
    responses=error_responses(401, 403, 422),
)
def list_user_checkpoints(
    principal: CurrentPrincipal,
    db: ReadSession,
    state: State,
    limit: int = Query(100, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=MAX_OFFSET),
) -> CheckpointsListResponse:
    """The caller's live checkpoints across all its runs, newest first."""
    rows, total = checkpoints.list_checkpoints(
        db, state.clock, principal.tenant_id, run_id=None, limit=limit, offset=offset
    )
    return _listing(rows, total, limit, offset)


@router.get(
    "/training_runs/{run_id}/checkpoints",
    response_model=CheckpointsListResponse,
    responses=error_responses(401, 403, 404, 422),
)
def list_run_checkpoints(
    run_id: str,
    principal: CurrentPrincipal,
    db: ReadSession,
    state: State,
    limit: int = Query(1000, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=MAX_OFFSET),
) -> CheckpointsListResponse:
    runs.get_run(db, principal.tenant_id, run_id)
    rows, total = checkpoints.list_checkpoints(
        db, state.clock, principal.tenant_id, run_id=run_id, limit=limit, offset=offset
    )
    return _listing(rows, total, limit, offset)


@router.post(
    CHECKPOINT + "/publish", status_code=204, responses=error_responses(401, 403, 404, 422)
)
def publish(
    run_id: str, kind: KindSegment, name: CheckpointName, principal: CurrentPrincipal, state: State
) -> None:
    """Make the checkpoint readable (sampling, loading, weights_info) by every tenant."""
    with state.database.transaction() as db:
        version = checkpoints.owned(db, state.clock, principal.tenant_id, run_id, f"{kind}/{name}")
        if not version.public:
            _audit(db, state.clock, principal, version, "checkpoint.published")
        checkpoints.set_public(version, True)


@router.delete(
    CHECKPOINT + "/publish", status_code=204, responses=error_responses(401, 403, 404, 422)
)
def unpublish(
    run_id: str, kind: KindSegment, name: CheckpointName, principal: CurrentPrincipal, state: State
) -> None:
    """Make the checkpoint private again; unpublishing a private one changes nothing."""
    with state.database.transaction() as db:
        version = checkpoints.owned(db, state.clock, principal.tenant_id, run_id, f"{kind}/{name}")
        if version.public:
            _audit(db, state.clock, principal, version, "checkpoint.unpublished")
        checkpoints.set_public(version, False)


@router.put(
    CHECKPOINT + "/ttl", status_code=204, responses=error_responses(401, 403, 404, 413, 422)
)
def set_ttl(
    run_id: str,
    kind: KindSegment,
    name: CheckpointName,
    body: SetCheckpointTtlRequest,
    principal: CurrentPrincipal,
    state: State,
) -> None:
    """Expire the checkpoint `ttl_seconds` from now (1 hour to 10 years), or never with null."""
    with state.database.transaction() as db:
        version = checkpoints.owned(db, state.clock, principal.tenant_id, run_id, f"{kind}/{name}")
        checkpoints.set_ttl(version, state.clock, body.ttl_seconds)


@router.get(
    CHECKPOINT + "/external_weights_urls",
    response_model=ExternalWeightsUrlsResponse,
    responses=error_responses(401, 403, 404, 422),
)
def external_weights_urls(
    run_id: str,
    kind: KindSegment,
    name: CheckpointName,
    request: Request,
    principal: CurrentPrincipal,
    db: ReadSession,
    state: State,
) -> ExternalWeightsUrlsResponse:
    """A signed URL per file of the checkpoint, fetchable without an API key until `expires`."""
    version = checkpoints.owned(db, state.clock, principal.tenant_id, run_id, f"{kind}/{name}")
    root = _artifact_root(state, version)
    expires = _download_expiry(version, state.clock)
    base = (state.settings.public_url or str(request.base_url)).rstrip("/")
    urls: dict[str, str] = {}
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        relpath = file.relative_to(root).as_posix()
        token = signing.sign_download(state.server_secret, version.id, relpath, expires)
        urls[relpath] = f"{base}/api/v1/artifacts/{token}/{quote(relpath)}"
    return ExternalWeightsUrlsResponse(urls=urls, expires=expires)


@router.delete(CHECKPOINT, status_code=204, responses=error_responses(401, 403, 404, 422))
def delete_checkpoint(
    run_id: str, kind: KindSegment, name: CheckpointName, principal: CurrentPrincipal, state: State
) -> None:
    """Retire the checkpoint (its path is free again) and remove its files."""
    with state.database.transaction() as db:
        version = checkpoints.owned(db, state.clock, principal.tenant_id, run_id, f"{kind}/{name}")
        checkpoints.require_unaliased(db, version, "delete")
        _audit(db, state.clock, principal, version, "checkpoint.deleted")
        uri = checkpoints.mark_deleted(version)
    # Only once the row is committed: a crash in between leaves an orphaned folder, never a
    # live checkpoint without files.
    if uri is not None:
        try:
            state.store.delete(uri)
        except OSError:
            logger.exception("removing the files of deleted checkpoint %s failed", uri)


@router.post(
    "/weights_info",
    response_model=WeightsInfoResponse,
    responses=error_responses(401, 403, 404, 413, 422),
)
def weights_info(
    body: WeightsInfoRequest, principal: CurrentPrincipal, db: ReadSession, state: State
) -> WeightsInfoResponse:
    """What a client needs to load the checkpoint: base model and LoRA shape."""
    version = checkpoints.resolve(db, state.clock, principal.tenant_id, body.tinker_path)
    package = db.get(ModelPackage, version.package_id)
    assert package is not None
    lora = version.lora_config or {}
    rank = lora.get("rank")
    return WeightsInfoResponse(
        base_model=package.base_model,
        is_lora=True,
        lora_rank=int(rank) if rank is not None else None,
        train_unembed=bool(lora.get("train_unembed", True)),
        train_mlp=bool(lora.get("train_mlp", True)),
        train_attn=bool(lora.get("train_attn", True)),
    )


def _artifact_root(state: State, version: ModelVersion) -> Path:
    try:
        if version.artifact_uri is None:
            raise FileNotFoundError(version.id)
        return state.store.open_dir(version.artifact_uri)
    except FileNotFoundError as exc:
        raise NotFound(
            f"the files of {version.tinker_path} are gone; save the weights again"
        ) from exc


def _download_expiry(version: ModelVersion, clock: Clock) -> datetime:
    expires = clock.now() + timedelta(seconds=DOWNLOAD_URL_SECONDS)
    if version.expires_at is not None:
        expires = min(expires, version.expires_at)
    return expires.replace(microsecond=0)
