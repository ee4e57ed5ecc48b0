"""The op log's states: every change of an operation's status is made here.

    queued ──claim──▶ running ──finish──▶ done
      ▲  │                │   └───fail───▶ failed
      │  │                │
      │  └───fail_now─────┼──────────────▶ failed   (a late arrival; given up after
      └────requeue────────┘                          too many interrupted attempts)

`queue` inserts an op; the other functions move it along. Each takes the caller's session: the
caller (a route, the worker host, beat) owns the transaction. A run's progress that follows
from an op's end is written through `core.runs`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import NamedTuple, cast

from sqlalchemy import (
    Executable,
    Integer,
    Select,
    Table,
    and_,
    bindparam,
    exists,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session as OrmSession
from sqlalchemy.orm import aliased, defer
from sqlalchemy.orm.attributes import set_committed_value

from core import runs
from core.tables import Operation, OpStatus, SamplingSession, TrainingRun
from scheduler import failures
from scheduler.failures import OpFailure
from scheduler.ops import OpKind

log = logging.getLogger(__name__)

# unload_model carries no seq_id on the wire: it runs after everything submitted before it,
# and anything after it arrives too late.
UNLOAD_SEQ = 1 << 62
IN_FLIGHT = (OpStatus.QUEUED, OpStatus.RUNNING)


def _queue_statement(insert: Callable[[Table], postgresql.Insert | sqlite.Insert]) -> Executable:
    operations = cast(Table, Operation.__table__)
    return (
        insert(operations)
        .on_conflict_do_nothing(index_elements=[operations.c.target_id, operations.c.seq_id])
        .returning(operations.c.id)
    )


# Built once and given its row at execution: it runs on every submission.
_QUEUE = {
    "postgresql": _queue_statement(postgresql.insert),
    "sqlite": _queue_statement(sqlite.insert),
}


def queue(db: OrmSession, row: dict[str, object]) -> bool:
    """Insert the op `row` (the operations table's columns) as queued; False when a concurrent
    twin holds its (target_id, seq_id) already, and then nothing was written: the caller's
    transaction goes on without it. One statement, with no savepoint and no ORM object: the
    index settles the race (on PostgreSQL the insert waits for the twin's transaction, and
    does nothing once it committed)."""
    statement = _QUEUE[db.get_bind().dialect.name]
    return db.execute(statement, {**row, "status": OpStatus.QUEUED}).first() is not None


def fail_now(op: Operation, failure: OpFailure, now: datetime) -> None:
    """Mark `op` failed with `failure`: one that ran, one that will never run (it arrived after
    its gap was given up), or one given up after too many attempts."""
    op.status, op.finished_at = OpStatus.FAILED, now
    failures.record(op, failure)


def queued_samples(db: OrmSession) -> int:
    """Sampling requests waiting for an engine, all tenants together (the sampling queue)."""
    waiting = (
        select(func.count())
        .select_from(Operation)
        .where(Operation.status == OpStatus.QUEUED, Operation.kind == OpKind.SAMPLE.value)
    )
    return db.scalar(waiting) or 0


# --- claiming ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ready:
    """A claimable op, with what the executor needs of its target."""

    op: Operation
    base_model: str
    sampler_version_id: str | None = None
    live_run_id: str | None = None
    """Of a sample on a live sampler: the training run whose current weights it samples."""


@dataclasses.dataclass(frozen=True)
class ReadyQueries:
    """The statements that find claimable work, built once per worker: the claim runs for every
    op, and building its statements costs more than running them. How many samples to take is
    bound at each claim (`max_samples`): a worker takes as many as its decode loops have room
    for."""

    training: Select[Operation, str]
    samples: Select[Operation, str, str | None, str | None]

    @classmethod
    def build(cls, worker_id: str | None) -> ReadyQueries:
        """Work of every target, or with `worker_id` only of the targets placed on it."""
        earlier = aliased(Operation)
        nothing_before = ~exists().where(
            earlier.target_id == Operation.target_id,
            earlier.status.in_(IN_FLIGHT),
            earlier.seq_id < Operation.seq_id,
        )
        # Each run's next seq_id, or an unload with nothing before it.
        training = (
            select(Operation, TrainingRun.base_model)
            .join(TrainingRun, TrainingRun.id == Operation.target_id)
            .where(
                Operation.status == OpStatus.QUEUED,
                or_(
                    Operation.seq_id == TrainingRun.executed_seq_id + 1,
                    and_(Operation.seq_id == UNLOAD_SEQ, nothing_before),
                ),
                *((TrainingRun.worker_id == worker_id,) if worker_id is not None else ()),
            )
        )
        # The oldest sampling requests first. A live sampler's requests run wherever its
        # training run is now (they follow it when it moves), beside the run's training ops.
        live = aliased(TrainingRun)
        placed_here = or_(
            and_(live.id.is_(None), SamplingSession.worker_id == worker_id),
            live.worker_id == worker_id,
        )
        samples = (
            select(Operation, SamplingSession.base_model, SamplingSession.model_version_id, live.id)
            .join(SamplingSession, SamplingSession.id == Operation.target_id)
            .outerjoin(
                live,
                and_(
                    live.id == SamplingSession.training_run_id,
                    SamplingSession.model_version_id.is_(None),
                ),
            )
            .where(
                Operation.status == OpStatus.QUEUED,
                Operation.kind == OpKind.SAMPLE.value,
                *((placed_here,) if worker_id is not None else ()),
            )
            .order_by(Operation.created_at)
            .limit(bindparam("max_samples", type_=Integer))
        )
        return cls(training, samples)


QUEUED_WORK = select(
    exists().where(Operation.status == OpStatus.QUEUED, Operation.kind != OpKind.SAMPLE.value),
    exists().where(Operation.status == OpStatus.QUEUED, Operation.kind == OpKind.SAMPLE.value),
)
"""Whether training ops and samples are queued, of any target: a cheap look before taking the
write lock, which also spares the claim the query of the kind that has none."""


def claim(
    db: OrmSession,
    queries: ReadyQueries,
    *,
    worker_id: str,
    now: datetime,
    max_attempts: int,
    max_samples: int,
    busy: bool = False,
    training: bool = True,
) -> tuple[list[Ready], list[Operation]]:
    """Mark what is ready now as running on `worker_id`, at most `max_samples` samples; also
    returns the ops given up instead (interrupted `max_attempts` times). An op interrupted
    before runs alone: if it is what brings a worker down, it takes nobody else with it. So
    while the worker is `busy` (samples of its decode loops in flight) it is not claimed, and
    nothing else is either, until the loops have run dry. Without `training`, only samples are
    looked for (none of the other ops was queued a moment ago)."""
    ready = [Ready(op, base) for op, base in db.execute(queries.training)] if training else []
    if max_samples > 0:
        ready += [
            Ready(op, base, version, live_run)
            for op, base, version, live_run in db.execute(
                queries.samples, {"max_samples": max_samples}
            )
        ]
    given_up = [r.op for r in ready if r.op.attempts >= max_attempts]
    for op in given_up:
        give_up(db, op, now)
    ready = [r for r in ready if r.op.attempts < max_attempts]
    retried = [r for r in ready if r.op.attempts > 0]
    if retried:
        ready = [] if busy else [min(retried, key=lambda r: r.op.created_at)]
    if ready:
        _mark_running(db, [r.op for r in ready], worker_id, now)
    return ready, given_up


# Built once: every claim runs it. One statement for the claim's ops, not one per op.
_MARK_RUNNING = (
    update(Operation)
    .where(Operation.id.in_(bindparam("op_ids", expanding=True)))
    .values(
        status=OpStatus.RUNNING,
        started_at=bindparam("now"),
        attempts=Operation.attempts + 1,
        worker_id=bindparam("claimer"),
    )
    .execution_options(synchronize_session=False)
)


def _mark_running(db: OrmSession, ops: list[Operation], worker_id: str, now: datetime) -> None:
    """Mark `ops` running on `worker_id`, in the database and, as already written there, on
    the loaded objects (so committing writes nothing more)."""
    db.execute(_MARK_RUNNING, {"op_ids": [op.id for op in ops], "now": now, "claimer": worker_id})
    for op in ops:
        for name, value in (
            ("status", OpStatus.RUNNING),
            ("started_at", now),
            ("attempts", op.attempts + 1),
            ("worker_id", worker_id),
        ):
            set_committed_value(op, name, value)


def release_gaps(db: OrmSession, now: datetime, gap_timeout: timedelta) -> None:
    """Skip seq_ids that never arrived, once a later op has waited past the gap timeout."""
    waiting = db.execute(
        select(TrainingRun, func.min(Operation.seq_id), func.min(Operation.created_at))
        .join(Operation, Operation.target_id == TrainingRun.id)
        .where(
            Operation.status == OpStatus.QUEUED,
            Operation.seq_id > TrainingRun.executed_seq_id + 1,
            Operation.seq_id < UNLOAD_SEQ,
        )
        .group_by(TrainingRun.id)
    ).all()
    for run, first_waiting, since in waiting:
        assert first_waiting is not None
        next_expected = run.executed_seq_id + 1
        has_next = db.scalar(
            select(func.count())
            .select_from(Operation)
            .where(Operation.target_id == run.id, Operation.seq_id == next_expected)
        )
        if not has_next and now - since >= gap_timeout:
            log.warning(
                "run %s: seq %d..%d never arrived; continuing with %d",
                run.id,
                next_expected,
                first_waiting - 1,
                first_waiting,
            )
            runs.skip_to(run, first_waiting)


# --- ending -----------------------------------------------------------------------------------


def _running(db: OrmSession, op_id: str) -> Operation | None:
    # The request body stays unread: it can be large, and it is no longer needed.
    op = db.get(Operation, op_id, options=[defer(Operation.payload)])
    return op if op is not None and op.status == OpStatus.RUNNING else None


class Finished(NamedTuple):
    """What `finish` reads back of the op it recorded done."""

    kind: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime
    status: str = OpStatus.DONE
    error_category: str | None = None


# Built once: it runs for every op. The parameters' names differ from the columns' (an
# UPDATE's own bound parameters take the columns' names).
_FINISH = (
    update(Operation)
    .where(Operation.id == bindparam("op_id"), Operation.status == OpStatus.RUNNING)
    .values(
        status=OpStatus.DONE,
        finished_at=bindparam("now"),
        result=bindparam("op_result"),
        result_codec=bindparam("op_codec"),
    )
    .returning(Operation.kind, Operation.created_at, Operation.started_at, Operation.finished_at)
    .execution_options(synchronize_session=False)
)


def finish(
    db: OrmSession, op_id: str, now: datetime, result: bytes | None, codec: str | None
) -> Finished | None:
    """Record a running op's result; None when it is not running (already recorded). One
    statement, which neither reads the op first nor loads it into the session."""
    row = db.execute(
        _FINISH, {"op_id": op_id, "now": now, "op_result": result, "op_codec": codec}
    ).first()
    if row is None:
        return None
    kind, created_at, started_at, finished_at = row
    assert finished_at is not None  # set by this very statement
    return Finished(kind, created_at, started_at, finished_at)


def fail(db: OrmSession, op_id: str, now: datetime, failure: OpFailure) -> Operation | None:
    """Record a running op's failure; None when it is not running (already recorded)."""
    op = _running(db, op_id)
    if op is not None:
        fail_now(op, failure, now)
    return op


def give_up(db: OrmSession, op: Operation, now: datetime) -> None:
    """Fail an op that was interrupted `op.attempts` times, so that it cannot stop its
    neighbours (or a restarted worker) again; its run's later ops go on."""
    log.error(
        "giving up on operation %s (%s of %s) after %d interrupted attempts",
        op.id,
        op.kind,
        op.target_id,
        op.attempts,
    )
    fail_now(
        op,
        OpFailure.server(
            f"{op.kind} was interrupted {op.attempts} times while the server executed it, so it "
            "was given up rather than tried again; check this request's inputs, send the work "
            "again as a new request, and report it to the operator if it recurs"
        ),
        now,
    )
    advance_run(db, OpKind(op.kind), op.target_id, op.seq_id, now)


def advance_run(
    db: OrmSession,
    kind: OpKind,
    target_id: str,
    seq_id: int | None,
    now: datetime,
    progress: runs.Progress = runs.NO_PROGRESS,
) -> runs.Advanced | None:
    """A training op ended (either way): its run's next op may run, and a successful one adds
    its `progress` to the run's counters (`runs.advance`). None for a sample, an op without
    seq_id, or a run that is gone."""
    if kind is OpKind.SAMPLE or seq_id is None:
        return None
    return runs.advance(db, target_id, seq_id, now, progress)


# --- requeueing -------------------------------------------------------------------------------


def requeue(
    db: OrmSession,
    op_ids: list[str],
    *,
    worker_id: str,
    max_attempts: int,
    now: datetime,
    counted: bool = True,
) -> list[Operation]:
    """Queue again the ops this worker claimed and could not record (a failed engine step), or
    give up on those tried `max_attempts` times; returns those given up.

    With `counted` false the claim is taken back instead (a worker stopping on purpose): the
    op was not interrupted by anything of its own, so it is neither given up nor made to run
    alone for it.
    """
    given_up = []
    for op_id in op_ids:
        op = db.get(Operation, op_id, options=[defer(Operation.payload)])
        if op is None or op.status != OpStatus.RUNNING or op.worker_id != worker_id:
            continue
        if not counted:
            op.status, op.attempts = OpStatus.QUEUED, max(op.attempts - 1, 0)
        elif op.attempts >= max_attempts:
            give_up(db, op, now)
            given_up.append(op)
        else:
            op.status = OpStatus.QUEUED
    return given_up


def queued_targets(db: OrmSession, target_ids: set[str]) -> set[str]:
    """Those of `target_ids` with operations queued."""
    if not target_ids:
        return set()
    return set(
        db.scalars(
            select(Operation.target_id)
            .where(Operation.status == OpStatus.QUEUED, Operation.target_id.in_(target_ids))
            .distinct()
        )
    )


def requeue_held_by(db: OrmSession, worker_ids: list[str]) -> None:
    """What these workers were running never finished (they restarted or died): queue it
    again, for whichever worker takes it next."""
    db.execute(
        update(Operation)
        .where(Operation.status == OpStatus.RUNNING, Operation.worker_id.in_(worker_ids))
        .values(status=OpStatus.QUEUED, worker_id=None)
    )


# --- retention --------------------------------------------------------------------------------

FINISHED = (OpStatus.DONE, OpStatus.FAILED)


def prune_payloads(db: OrmSession, op_ids: list[str], now: datetime) -> int:
    """Empty the stored requests of these finished ops (`scheduler.retention` chooses them:
    nothing can replay them any more); their results stay. Returns how many were pruned now:
    an op pruned before, or not finished, is left as it is."""
    if not op_ids:
        return 0
    pruned = db.execute(
        update(Operation)
        .where(
            Operation.id.in_(op_ids),
            Operation.status.in_(FINISHED),
            Operation.payload_pruned_at.is_(None),
        )
        .values(payload=b"", payload_pruned_at=now)
        .execution_options(synchronize_session=False)
    )
    return int(pruned.rowcount or 0)  # type: ignore[attr-defined]
