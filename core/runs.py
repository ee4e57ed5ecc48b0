"""Training runs and sampling sessions: the one place their rows are written, and
tenant-scoped reads.

A training run's row is created together with the submission of its creation op (create_model,
or a create-via-load); both are keyed by `(session_id, model_seq_id)`, so a retried creation
returns the same run. A sampling session is keyed by `(session_id, seq)` the same way. A run's
later changes — its status, the worker holding it, its progress through the op log, its
snapshots — are the functions below; the scheduler decides when, and the caller owns the
transaction. Every read here is scoped by tenant.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import BigInteger, Executable, Integer, bindparam, case, func, select, update
from sqlalchemy.orm import Session as OrmSession

from core.clock import Clock
from core.errors import InvalidInput, NotFound
from core.ids import sampling_session_id, training_run_id
from core.tables import RunStatus, SamplingSession, Session, SessionStatus, TrainingRun

# `live:<training run id>`, a model path that samples a run's current weights (a Treadle
# extension of the Tinker protocol's model paths). The tinker SDK sends only `tinker://` paths,
# so `tinker://live:<training run id>` names the same.
LIVE_PREFIX = "live:"

# The adapter a create_model without a LoRA config gets; a config without a rank gets this rank.
DEFAULT_LORA_RANK = 32


def lora_rank(lora_config: Mapping[str, Any]) -> int:
    return int(lora_config.get("rank", DEFAULT_LORA_RANK))


# A run in one of these holds (or is about to hold) memory on the worker placed for it.
HOLDING = (RunStatus.PENDING, RunStatus.ACTIVE)


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
        lora_rank=lora_rank(lora_config),
        lora_config=lora_config,
        user_metadata=user_metadata,
        status=RunStatus.PENDING,
        executed_seq_id=-1,  # the creation op is seq 0
        created_at=now,
        last_request_at=now,
    )
    db.add(run)
    db.flush()
    return run, True


def activate(run: TrainingRun) -> None:
    """Its create_model or load finished: the run takes requests."""
    run.status = RunStatus.ACTIVE


def unload(run: TrainingRun) -> None:
    """unload_model ran: the engine holds the run no more."""
    run.status = RunStatus.UNLOADED


def fail(run: TrainingRun) -> None:
    """The run's state was lost and cannot be rebuilt: it never runs again."""
    run.status = RunStatus.FAILED


def ended(run: TrainingRun) -> str | None:
    """How an unloaded or failed run ended, as the refusals of its requests say it (None while
    it may still run)."""
    if run.status == RunStatus.UNLOADED:
        return "was unloaded"
    if run.status == RunStatus.FAILED:
        return (
            "failed (its state was lost, by a restart or with a worker, and could not be "
            "restored; its failed requests say why)"
        )
    return None


def touch(run: TrainingRun, now: datetime) -> None:
    """A request for the run arrived or finished."""
    run.last_request_at = now


@dataclasses.dataclass(frozen=True)
class Progress:
    """What a successful training op adds to its run's counters."""

    optim_steps: int = 0
    trained_tokens: int | None = None
    """Tokens it trained on (None: it trains nothing, and the run's count stays as it is)."""


NO_PROGRESS = Progress()


class Advanced(NamedTuple):
    """What `advance` reads back of the run it advanced."""

    optim_steps: int
    snapshot_uri: str | None


def _advance_statement() -> Executable:
    seq_id = bindparam("op_seq", type_=BigInteger)
    trained = bindparam("trained", type_=BigInteger)
    return (
        update(TrainingRun)
        .where(TrainingRun.id == bindparam("run_id"))
        .values(
            executed_seq_id=case(
                (TrainingRun.executed_seq_id < seq_id, seq_id), else_=TrainingRun.executed_seq_id
            ),
            last_request_at=bindparam("now"),
            optim_steps=TrainingRun.optim_steps + bindparam("steps", type_=Integer),
            tokens_trained=case(
                (trained.is_(None), TrainingRun.tokens_trained),
                else_=func.coalesce(TrainingRun.tokens_trained, 0) + trained,
            ),
        )
        .returning(TrainingRun.optim_steps, TrainingRun.snapshot_uri)
        .execution_options(synchronize_session=False)
    )


# Built once: every training op runs it as it is recorded.
_ADVANCE = _advance_statement()


def advance(
    db: OrmSession, run_id: str, seq_id: int, now: datetime, progress: Progress = NO_PROGRESS
) -> Advanced | None:
    """The run's op `seq_id` ended (either way): the next one may run, and `progress` is added
    to the run's counters. One statement, which loads no run into the session (changes to a
    run loaded before are written first); returns what it read back, or None when the run is
    gone."""
    row = db.execute(
        _ADVANCE,
        {
            "run_id": run_id,
            "op_seq": seq_id,
            "now": now,
            "steps": progress.optim_steps,
            "trained": progress.trained_tokens,
        },
    ).first()
    return None if row is None else Advanced(*row)


def skip_to(run: TrainingRun, seq_id: int) -> None:
    """Give up on the ops before `seq_id` that never arrived: it runs next."""
    run.executed_seq_id = seq_id - 1


def set_steps(run: TrainingRun, steps: int) -> None:
    """The run's engine now counts `steps` optimizer steps (it loaded a checkpoint)."""
    run.optim_steps = steps


def loaded_from(run: TrainingRun, version_id: str | None) -> None:
    """The run's weights now come from model version `version_id` (a load_weights succeeded):
    the versions it saves from here on descend from it."""
    run.loaded_from_version_id = version_id


def record_snapshot(run: TrainingRun, seq_id: int, uri: str) -> None:
    """The run's full state after op `seq_id` is saved at `uri`: replay starts there."""
    run.snapshot_seq_id, run.snapshot_uri = seq_id, uri


def ended_with_snapshots(db: OrmSession, limit: int) -> list[TrainingRun]:
    """Runs that never execute again (unloaded or failed, their session ended) still naming a
    snapshot: recovery will never read it."""
    return list(
        db.scalars(
            select(TrainingRun)
            .join(Session, Session.id == TrainingRun.session_id)
            .where(
                TrainingRun.snapshot_uri.is_not(None),
                TrainingRun.status.in_((RunStatus.UNLOADED, RunStatus.FAILED)),
                Session.status != SessionStatus.ACTIVE,
            )
            .limit(limit)
        )
    )


def forget_snapshot(run: TrainingRun, uri: str) -> None:
    """The snapshot at `uri` was removed; replay can no longer start from it."""
    if run.snapshot_uri == uri:
        run.snapshot_uri = None


def assign_worker(run: TrainingRun | SamplingSession, worker_id: str | None) -> None:
    """Place a run or a sampler on a worker (None: on none, until one can take it)."""
    run.worker_id = worker_id


def unpin(db: OrmSession, worker_ids: list[str]) -> None:
    """Runs and samplers held by these (dead) workers are held by none until placed again."""
    for table in (TrainingRun, SamplingSession):
        db.execute(update(table).where(table.worker_id.in_(worker_ids)).values(worker_id=None))


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


def live_run_id(model_path: str) -> str | None:
    """The training run a `live:<run id>` (or `tinker://live:<run id>`) model path names; None
    for any other path."""
    model_path = model_path.removeprefix("tinker://")
    if not model_path.startswith(LIVE_PREFIX):
        return None
    run_id = model_path.removeprefix(LIVE_PREFIX)
    if not run_id:
        raise InvalidInput(
            "model path 'live:' names no training run; pass live:<training run id> (the "
            "model_id of a training client)"
        )
    return run_id


def is_live(sampler: SamplingSession) -> bool:
    """Whether the sampling session samples its training run's current weights."""
    return sampler.training_run_id is not None and sampler.model_version_id is None


def live_refusal(run: TrainingRun, session_status: str | None) -> str | None:
    """Why the run's current weights cannot be sampled (None: they can). `session_status` is
    that of the run's own session (None: the session is gone)."""
    if session_status != SessionStatus.ACTIVE:
        return (
            f"training run {run.id} no longer holds weights to sample: its session ended; "
            "save a checkpoint while the run is live and sample that, or sample a new run"
        )
    end = ended(run)
    if end is not None:
        return (
            f"training run {run.id} {end} and holds no weights to sample; sample a checkpoint "
            "it saved, or a live run"
        )
    return None


def require_live(db: OrmSession, tenant_id: str, run_id: str) -> TrainingRun:
    """The tenant's training run whose current weights can be sampled now (404 for a missing
    or foreign run, a user error for one that ended or is still starting)."""
    run = get_run(db, tenant_id, run_id)
    status = db.scalar(select(Session.status).where(Session.id == run.session_id))
    refusal = live_refusal(run, status)
    if refusal is not None:
        raise InvalidInput(refusal)
    if run.status != RunStatus.ACTIVE:
        raise InvalidInput(
            f"training run {run.id} is still starting (its create_model or load has not "
            "finished); wait for it, then sample it live"
        )
    return run


def get_sampling_session(db: OrmSession, tenant_id: str, sampler_id: str) -> SamplingSession:
    sampler = db.get(SamplingSession, sampler_id)
    if sampler is None or sampler.tenant_id != tenant_id:
        raise NotFound(
            f"sampling session {sampler_id!r} not found; create one with create_sampling_session"
        )
    return sampler
