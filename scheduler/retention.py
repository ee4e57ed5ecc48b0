"""Op-log retention: empty the stored requests that nothing can replay any more.

An operation's payload is what recovery replays after a worker dies, but only for a training
run's ops after its latest snapshot. A finished op's payload is emptied (`oplog.prune_payloads`)
once it finished more than `TREADLE_OPLOG_RETENTION_SECONDS` ago and it is one of:

- a training run's op at or below the run's snapshot (replay starts after it);
- a sampling request (samples are never replayed);
- an op of a run that was unloaded or failed and whose session ended (it never runs again).

Queued and running ops, and a live run's ops after its snapshot, are never touched. Results are
kept: they are what futures return, and futures do not expire. The job is idempotent and works
in bounded batches, one transaction each; on PostgreSQL concurrent runs skip each other's rows.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy import Select, and_, bindparam, or_, select

from core.clock import Clock
from core.db import Database
from core.periodic import due
from core.settings import Settings
from core.tables import Operation, RunStatus, Session, SessionStatus, TrainingRun
from scheduler import oplog
from scheduler.ops import OpKind

log = logging.getLogger(__name__)

BATCH = 1000
"""Ops pruned per transaction."""
EVERY_SECONDS = 600.0
"""How often the periodic job runs: payloads are kept for days, so minutes late is nothing."""

# A run in one of these never executes again (nothing is claimed for it).
_ENDED_RUN = (RunStatus.UNLOADED, RunStatus.FAILED)


def _prunable() -> Select[str]:
    """Up to `:batch` ops whose payload may go, finished before `:cutoff`, oldest first."""
    never_replayed = or_(
        Operation.kind == OpKind.SAMPLE.value,
        Operation.seq_id <= TrainingRun.snapshot_seq_id,
        and_(TrainingRun.status.in_(_ENDED_RUN), Session.status != SessionStatus.ACTIVE),
    )
    return (
        select(Operation.id)
        .outerjoin(TrainingRun, TrainingRun.id == Operation.target_id)
        .outerjoin(Session, Session.id == TrainingRun.session_id)
        .where(
            Operation.payload_pruned_at.is_(None),
            Operation.finished_at < bindparam("cutoff"),
            Operation.status.in_(oplog.FINISHED),
            never_replayed,
        )
        .order_by(Operation.finished_at)
        .limit(bindparam("batch"))
        # A second pruner (two beats during a hand-over) takes other rows instead of waiting.
        .with_for_update(of=Operation, skip_locked=True)
    )


_PRUNABLE = _prunable()


def prune(database: Database, clock: Clock, retention: timedelta, *, batch: int = BATCH) -> int:
    """Empty every prunable payload of ops finished more than `retention` ago; returns how many
    were emptied (0 when run again)."""
    now = clock.now()
    cutoff = now - retention
    total = 0
    while True:
        with database.transaction() as db:
            op_ids = list(db.scalars(_PRUNABLE, {"cutoff": cutoff, "batch": batch}))
            total += oplog.prune_payloads(db, op_ids, now)
        if len(op_ids) < batch:
            break
    if total:
        log.info("op-log retention emptied %d payloads of ops finished before %s", total, cutoff)
    return total


def run_periodic(database: Database, settings: Settings, clock: Clock) -> None:
    """Prune if EVERY_SECONDS passed since this process last did on `database`; a failure is
    logged and retried at the next interval. Called by beat's tick and the embedded server."""
    if not due("retention", database, clock.now(), EVERY_SECONDS):
        return
    try:
        prune(database, clock, timedelta(seconds=settings.oplog_retention_seconds))
    except Exception:
        log.exception("op-log retention failed; retrying next interval")
