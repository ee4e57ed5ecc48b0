"""Training runs and sampling sessions: where their rows are created, and tenant-scoped reads.

A training run's row is created together with the submission of its creation op (create_model,
or a create-via-load); both are keyed by `(session_id, model_seq_id)`, so a retried creation
returns the same run. A sampling session is keyed by `(session_id, seq)` the same way. The
rows' later changes (status, placement on a worker, progress through the op log) are made by
the scheduler, not here. Every read here is scoped by tenant.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session as OrmSession

from core.clock import Clock
from core.errors import InvalidInput, NotFound
from core.ids import sampling_session_id, training_run_id
from core.tables import SamplingSession, TrainingRun

PENDING, ACTIVE, UNLOADED, FAILED = "pending", "active", "unloaded", "failed"


def create_training_run(
    db: OrmSession,
    clock: Clock,
    *,
    tenant_id: str,
    session_id: str,
    model_seq_id: int,
    base_model: str,
    lora_config: dict[str, Any],
    user_metadata: dict[str, Any] | None,
) -> tuple[TrainingRun, bool]:
    """The run for `(session_id, model_seq_id)`, and whether this call created it."""
    if model_seq_id < 0:
        raise InvalidInput(f"model_seq_id {model_seq_id} is negative; count models from 0")
    run_id = training_run_id(session_id, model_seq_id)
    existing = db.get(TrainingRun, run_id)
    if existing is not None:
        if existing.tenant_id != tenant_id:
            raise NotFound(f"session {session_id!r} not found")
        return existing, False
    now = clock.now()
    run = TrainingRun(
        id=run_id,
        tenant_id=tenant_id,
        session_id=session_id,
        model_seq_id=model_seq_id,
        base_model=base_model,
        lora_rank=int(lora_config.get("rank", 0)),
        lora_config=lora_config,
        user_metadata=user_metadata,
        status=PENDING,
        executed_seq_id=-1,  # the creation op is seq 0
        created_at=now,
        last_request_at=now,
    )
    db.add(run)
    db.flush()
    return run, True


def get_run(db: OrmSession, tenant_id: str, run_id: str) -> TrainingRun:
    run = db.get(TrainingRun, run_id)
    if run is None or run.tenant_id != tenant_id:
        raise NotFound(f"training run {run_id!r} not found; create it with create_model first")
    return run


def list_runs(
    db: OrmSession, tenant_id: str, *, limit: int, offset: int
) -> tuple[list[TrainingRun], int]:
    scoped = TrainingRun.tenant_id == tenant_id
    total = db.scalar(select(func.count()).select_from(TrainingRun).where(scoped)) or 0
    rows = db.scalars(
        select(TrainingRun)
        .where(scoped)
        .order_by(TrainingRun.created_at.desc(), TrainingRun.id)
        .limit(limit)
        .offset(offset)
    )
    return list(rows), total


def create_sampling_session(
    db: OrmSession,
    clock: Clock,
    *,
    tenant_id: str,
    session_id: str,
    seq: int,
    base_model: str,
    model_path: str | None,
    training_run_id: str | None,
    model_version_id: str | None,
) -> SamplingSession:
    """The sampling session for `(session_id, seq)`; a retried creation returns the same one."""
    sampler_id = sampling_session_id(session_id, seq)
    existing = db.get(SamplingSession, sampler_id)
    if existing is not None:
        if existing.tenant_id != tenant_id:
            raise NotFound(f"session {session_id!r} not found")
        return existing
    sampler = SamplingSession(
        id=sampler_id,
        tenant_id=tenant_id,
        session_id=session_id,
        sampling_session_seq_id=seq,
        base_model=base_model,
        model_path=model_path,
        training_run_id=training_run_id,
        model_version_id=model_version_id,
        created_at=clock.now(),
    )
    db.add(sampler)
    db.flush()
    return sampler


def get_sampling_session(db: OrmSession, tenant_id: str, sampler_id: str) -> SamplingSession:
    sampler = db.get(SamplingSession, sampler_id)
    if sampler is None or sampler.tenant_id != tenant_id:
        raise NotFound(
            f"sampling session {sampler_id!r} not found; create one with create_sampling_session"
        )
    return sampler
