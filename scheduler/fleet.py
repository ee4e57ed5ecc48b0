"""Where things are: the live training runs, the workers and the operations that wait too long.

A read model for operators (`treadle-server admin runs|workers|ops`, and any later dashboard):
plain queries over the caller's session returning frozen rows, computed at the `now` given. It
writes nothing and decides nothing; each reason it gives for a waiting op is read off the same
rules the scheduler follows: placement (`scheduler.placement`), the lease that makes a worker
alive (`scheduler.workers`), and the worker's rule that a run's ops execute in seq_id order
(`scheduler.oplog.ReadyQueries`), a missing seq_id being skipped only after the gap timeout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, and_, case, func, or_, select
from sqlalchemy.orm import Session as OrmSession

from core import runs as core_runs
from core.settings import Settings
from core.tables import (
    Operation,
    OpStatus,
    RunStatus,
    SamplingSession,
    Session,
    SessionStatus,
    Tenant,
    TrainingRun,
    Worker,
    WorkerStatus,
)
from scheduler import placement
from scheduler.oplog import IN_FLIGHT, UNLOAD_SEQ
from scheduler.workers import is_alive

RUNNING = (WorkerStatus.LIVE, WorkerStatus.DRAINING)
"""Workers that run: those shown one by one whatever they hold."""


@dataclasses.dataclass(frozen=True)
class RunRow:
    """A training run that holds (or is about to hold) weights on a worker."""

    run_id: str
    tenant_id: str
    tenant_name: str
    base_model: str
    lora_rank: int
    worker_id: str | None
    status: str
    ops_in_flight: int
    """Its operations queued or running."""
    last_op_age_seconds: float | None
    """Since its newest operation was submitted or finished; None when it has none."""


@dataclasses.dataclass(frozen=True)
class WorkerRow:
    worker_id: str
    hostname: str
    device: str
    """Its first device; a worker group's rank 0's."""
    group_size: int
    """Ranks (devices) of the worker group it is; 1 for one device."""
    status: str
    lease_expires_in_seconds: float
    """Until its lease lapses; negative: it lapsed that long ago."""
    runs_placed: int
    """Live training runs placed on it, as the runs table says."""
    runs_reported: int
    """Runs its engine held at its last lease renewal."""
    adapter_bytes: int
    queued_ops: int
    """Operations queued for the runs and samplers placed on it."""


@dataclasses.dataclass(frozen=True)
class StuckOp:
    op_id: str
    tenant_id: str
    target_id: str
    seq_id: int | None
    kind: str
    status: str
    waited_seconds: float
    """Queued: since it was submitted; running: since it started."""
    reason: str


def _seconds(now: datetime, then: datetime) -> float:
    return (now - then).total_seconds()


def runs(
    db: OrmSession, now: datetime, tenant: str | None = None, worker: str | None = None
) -> list[RunRow]:
    """The training runs a client can still use: holding (`core.runs.HOLDING`: neither unloaded
    nor failed) in an active session; optionally only a tenant's (by id) or a worker's."""
    query = (
        select(TrainingRun, Tenant.name)
        .join(Session, Session.id == TrainingRun.session_id)
        .join(Tenant, Tenant.id == TrainingRun.tenant_id)
        .where(TrainingRun.status.in_(core_runs.HOLDING), Session.status == SessionStatus.ACTIVE)
        .order_by(Tenant.name, TrainingRun.created_at, TrainingRun.id)
    )
    if tenant is not None:
        query = query.where(TrainingRun.tenant_id == tenant)
    if worker is not None:
        query = query.where(TrainingRun.worker_id == worker)
    found = db.execute(query).all()
    activity = _op_activity(db, [run.id for run, _ in found])
    rows = []
    for run, tenant_name in found:
        in_flight, last = activity.get(run.id, (0, None))
        rows.append(
            RunRow(
                run_id=run.id,
                tenant_id=run.tenant_id,
                tenant_name=tenant_name,
                base_model=run.base_model,
                lora_rank=run.lora_rank,
                worker_id=run.worker_id,
                status=run.status,
                ops_in_flight=in_flight,
                last_op_age_seconds=None if last is None else _seconds(now, last),
            )
        )
    return rows


def _op_activity(db: OrmSession, run_ids: list[str]) -> dict[str, tuple[int, datetime | None]]:
    """Run id → (its ops queued or running, when its newest op was submitted or finished)."""
    if not run_ids:
        return {}
    in_flight = func.sum(case((Operation.status.in_(IN_FLIGHT), 1), else_=0))
    rows = db.execute(
        select(
            Operation.target_id,
            in_flight,
            func.max(Operation.created_at),
            func.max(Operation.finished_at),
        )
        .where(Operation.target_id.in_(run_ids))
        .group_by(Operation.target_id)
    ).all()
    return {
        target: (int(count or 0), created if finished is None else max(created, finished))
        for target, count, created, finished in rows
    }


def queued_by_worker(db: OrmSession) -> dict[str | None, int]:
    """Queued operations by the worker their run or sampler is placed on (None: placed on no
    worker yet, or gone), as the worker claiming them sees it. The counts come from one
    statement, so they add up to the queue whatever commits meanwhile."""
    queued = dict(
        db.execute(
            select(Operation.target_id, func.count())
            .where(Operation.status == OpStatus.QUEUED)
            .group_by(Operation.target_id)
        ).all()
    )
    targets = _targets(db, queued)
    on: dict[str | None, int] = {}
    for target_id, count in queued.items():
        target = targets.get(target_id)
        worker_id = None if target is None else target.worker_id
        on[worker_id] = on.get(worker_id, 0) + count
    return on


def workers(
    db: OrmSession,
    now: datetime,
    *,
    queued: Mapping[str | None, int] | None = None,
    shown_only: bool = False,
) -> list[WorkerRow]:
    """Every worker ever registered, by id: live, draining, dead or gone; with `shown_only`,
    those that run (live or draining) or still have ops queued on them. `queued` is
    `queued_by_worker`'s answer when the caller read it already."""
    queued = queued_by_worker(db) if queued is None else queued
    query = select(Worker).order_by(Worker.id)
    if shown_only:
        holding = [worker_id for worker_id, count in queued.items() if worker_id and count]
        query = query.where(or_(Worker.status.in_(RUNNING), Worker.id.in_(holding)))
    found = db.scalars(query).all()
    placed = dict(
        db.execute(
            select(TrainingRun.worker_id, func.count())
            .where(
                TrainingRun.status.in_(core_runs.HOLDING),
                TrainingRun.worker_id.in_([w.id for w in found])
                if shown_only
                else TrainingRun.worker_id.is_not(None),
            )
            .group_by(TrainingRun.worker_id)
        ).all()
    )
    return [
        WorkerRow(
            worker_id=w.id,
            hostname=w.hostname,
            device=w.device,
            group_size=w.group_size,
            status=w.status,
            lease_expires_in_seconds=_seconds(w.lease_expires_at, now),
            runs_placed=placed.get(w.id, 0),
            runs_reported=w.held_runs,
            adapter_bytes=w.adapter_bytes,
            queued_ops=queued.get(w.id, 0),
        )
        for w in found
    ]


@dataclasses.dataclass(frozen=True)
class _Target:
    """Where an op's target is placed, as the worker claiming its ops sees it."""

    worker_id: str | None
    base_model: str
    run: TrainingRun | None
    """The training run itself, or the one a live sampler follows (its samples run there)."""
    ordered: bool
    """A training run: its ops execute one at a time, in seq_id order."""


def _targets(db: OrmSession, target_ids: Iterable[str]) -> dict[str, _Target]:
    ids = list(target_ids)
    if not ids:
        return {}
    found = {
        run.id: _Target(run.worker_id, run.base_model, run, ordered=True)
        for run in db.scalars(select(TrainingRun).where(TrainingRun.id.in_(ids)))
    }
    for sampler in db.scalars(select(SamplingSession).where(SamplingSession.id.in_(ids))):
        followed = (
            db.get(TrainingRun, sampler.training_run_id) if core_runs.is_live(sampler) else None
        )
        found[sampler.id] = (
            _Target(sampler.worker_id, sampler.base_model, None, ordered=False)
            if followed is None
            else _Target(followed.worker_id, followed.base_model, followed, ordered=False)
        )
    return found


@dataclasses.dataclass(frozen=True)
class _RunOrder:
    """What a run's ops wait for: its ops in flight by seq_id, and whether the seq_id it
    executes next was ever submitted."""

    in_flight: dict[str, dict[int, str]]
    next_submitted: set[str]

    @classmethod
    def read(cls, db: OrmSession, run_ids: list[str]) -> _RunOrder:
        in_flight: dict[str, dict[int, str]] = {run_id: {} for run_id in run_ids}
        if not run_ids:
            return cls(in_flight, set())
        for target_id, seq_id, status in db.execute(
            select(Operation.target_id, Operation.seq_id, Operation.status).where(
                Operation.target_id.in_(run_ids),
                Operation.status.in_(IN_FLIGHT),
            )
        ):
            if seq_id is not None:
                in_flight[target_id][seq_id] = status
        next_submitted = set(
            db.scalars(
                select(Operation.target_id)
                .join(TrainingRun, TrainingRun.id == Operation.target_id)
                .where(
                    Operation.target_id.in_(run_ids),
                    Operation.seq_id == TrainingRun.executed_seq_id + 1,
                )
            )
        )
        return cls(in_flight, next_submitted)

    def waits_for(self, run: TrainingRun, seq_id: int, gap_timeout: float) -> str | None:
        """Why the run's op `seq_id` is not its next, as `oplog.ReadyQueries` decides; None
        when it is."""
        next_seq = run.executed_seq_id + 1
        earlier = sorted(s for s in self.in_flight[run.id] if s < seq_id)
        if seq_id != UNLOAD_SEQ and seq_id > next_seq and run.id not in self.next_submitted:
            return (
                f"waiting for seq_id {next_seq}, never submitted (skipped once a later op has "
                f"waited {gap_timeout:g} s)"
            )
        if (seq_id == UNLOAD_SEQ or seq_id > next_seq) and earlier:
            return f"behind seq_id {earlier[0]}, {self.in_flight[run.id][earlier[0]]}"
        return None


def _waiting_since(cutoff: datetime) -> ColumnElement[bool]:
    return or_(
        and_(Operation.status == OpStatus.QUEUED, Operation.created_at <= cutoff),
        and_(Operation.status == OpStatus.RUNNING, Operation.started_at <= cutoff),
    )


def count_stuck_ops(db: OrmSession, now: datetime, older_than_seconds: float) -> int:
    """How many ops `stuck_ops` would list without a limit."""
    cutoff = now - timedelta(seconds=older_than_seconds)
    return db.scalar(select(func.count()).where(_waiting_since(cutoff))) or 0


def stuck_ops(
    db: OrmSession,
    now: datetime,
    settings: Settings,
    older_than_seconds: float,
    *,
    limit: int | None = None,
) -> list[StuckOp]:
    """Operations queued, or running, for longer than `older_than_seconds`, oldest first (the
    oldest `limit` of them, if given), each with why it has not finished. A queued op may have
    several reasons, joined by '; '."""
    cutoff = now - timedelta(seconds=older_than_seconds)
    ops = db.execute(
        select(
            Operation.id,
            Operation.tenant_id,
            Operation.target_id,
            Operation.seq_id,
            Operation.kind,
            Operation.status,
            Operation.created_at,
            Operation.started_at,
            Operation.worker_id,
        )
        .where(_waiting_since(cutoff))
        .order_by(Operation.created_at, Operation.id)
        .limit(limit)
    ).all()
    targets = _targets(db, {op.target_id for op in ops})
    order = _RunOrder.read(db, [t for t, target in targets.items() if target.ordered])
    fleet = _Fleet(db, now, settings)
    stuck = []
    for op in ops:
        if op.status == OpStatus.RUNNING:
            since = op.started_at
            reason = _running_reason(fleet, now, op.worker_id, since)
        else:
            since = op.created_at
            reason = "; ".join(
                _queued_reasons(fleet, settings, targets.get(op.target_id), op.seq_id, order)
            )
        stuck.append(
            StuckOp(
                op_id=op.id,
                tenant_id=op.tenant_id,
                target_id=op.target_id,
                seq_id=op.seq_id,
                kind=op.kind,
                status=op.status,
                waited_seconds=_seconds(now, since),
                reason=reason,
            )
        )
    return stuck


class _Fleet:
    """Which workers are alive and which models a live worker serves, each looked up once per
    listing rather than once per op."""

    def __init__(self, db: OrmSession, now: datetime, settings: Settings) -> None:
        self._db, self._now, self._settings = db, now, settings
        self._alive: dict[str, bool] = {}
        self._served: dict[str, bool] = {}

    def alive(self, worker_id: str) -> bool:
        if worker_id not in self._alive:
            self._alive[worker_id] = is_alive(self._db, worker_id, self._now)
        return self._alive[worker_id]

    def served(self, base_model: str) -> bool:
        if base_model not in self._served:
            servers = placement.live_servers(self._db, self._settings, self._now, base_model)
            self._served[base_model] = bool(servers)
        return self._served[base_model]


def _running_reason(fleet: _Fleet, now: datetime, worker_id: str, since: datetime) -> str:
    if not fleet.alive(worker_id):
        return f"worker {worker_id} not alive"
    return f"running on {worker_id} for {_seconds(now, since):.0f} s"


def _queued_reasons(
    fleet: _Fleet,
    settings: Settings,
    target: _Target | None,
    seq_id: int | None,
    order: _RunOrder,
) -> list[str]:
    if target is None:
        return ["its training run or sampler no longer exists"]
    reasons = []
    if target.run is not None and target.run.status == RunStatus.FAILED:
        reasons.append("run failed")
    lapsed = target.worker_id is not None and not fleet.alive(target.worker_id)
    if lapsed:
        reasons.append(f"worker {target.worker_id} not alive")
    if (target.worker_id is None or lapsed) and not fleet.served(target.base_model):
        reasons.append(f"no live worker serves {target.base_model}")
    if target.ordered and target.run is not None and seq_id is not None:
        waits = order.waits_for(target.run, seq_id, settings.gap_timeout_seconds)
        if waits is not None:
            reasons.append(waits)
    if reasons:
        return reasons
    if target.worker_id is None:
        return ["not placed yet (beat places queued work every few seconds)"]
    return [f"ready on {target.worker_id}, not yet claimed"]
