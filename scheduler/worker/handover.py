"""Leaving on purpose: a stopping worker saves its runs and hands them to live workers.

A worker stopped on purpose (SIGTERM, `treadle-server admin workers drain`) does in a second
what a crash leaves to the lease and beat: once its step in progress is done and its samples
are given back, it saves the state of each run it holds that ran past its latest snapshot with
no gradients pending, so that whoever takes the run next restores it without replaying
anything; then, in one transaction, it marks itself left, queues again what it was running,
unpins its runs and samplers and places those with queued work on live workers, which the
caller wakes.

Everything is guarded against beat having declared the worker dead meanwhile (a hand-over
slower than the lease): beat then owns the failover, and the worker records nothing, deletes
nothing and places nothing, since another worker may already be restoring its runs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sqlalchemy import select

from core import runs
from core.clock import Clock
from core.db import Database
from core.objectstore import ArtifactStore
from core.settings import Settings
from core.tables import SamplingSession, TrainingRun
from scheduler import oplog, workers
from scheduler.placement import place

if TYPE_CHECKING:
    from gpu_worker.engine import Engine
    from scheduler.worker.execute import Executor

log = logging.getLogger(__name__)


def save_quiet_runs(
    engine: Engine,
    executor: Executor,
    store: ArtifactStore,
    database: Database,
    clock: Clock,
    worker_id: str,
) -> int:
    """Snapshot the training runs this engine holds for `worker_id` that ran past their latest
    snapshot with no gradients pending; returns how many were saved. The caller holds the
    host's step lock (so what the engine holds is what was recorded: a failed step drops its
    runs from the engine)."""
    with database.reader() as db:
        rows = db.execute(
            select(
                TrainingRun.id,
                TrainingRun.tenant_id,
                TrainingRun.executed_seq_id,
                TrainingRun.snapshot_seq_id,
                TrainingRun.snapshot_uri,
            ).where(
                TrainingRun.id.in_(engine.run_ids()),
                TrainingRun.worker_id == worker_id,
                TrainingRun.status.in_(runs.HOLDING),
            )
        ).all()
    saved = 0
    for run_id, tenant_id, executed, snapshotted, previous in rows:
        behind = previous is None or snapshotted is None or snapshotted < executed
        if not behind or engine.gradients_pending(run_id):
            continue
        try:
            uri = executor.snapshot(tenant_id, run_id, executed)
            with database.transaction() as db:
                run = db.get(TrainingRun, run_id)
                recorded = (
                    run is not None
                    and run.worker_id == worker_id
                    and run.executed_seq_id == executed
                    and workers.is_alive(db, worker_id, clock.now())
                )
                if recorded:
                    assert run is not None
                    runs.record_snapshot(run, executed, uri)
        except Exception:
            log.exception(
                "saving %s before leaving failed; whoever takes it replays from its latest "
                "snapshot",
                run_id,
            )
            continue
        if not recorded:
            # Beat moved it meanwhile: its next worker restores from `previous`, untouched.
            store.delete(uri)
            continue
        if previous is not None and previous != uri:
            store.delete(previous)
        saved += 1
    return saved


def leave(
    database: Database, clock: Clock, settings: Settings, worker_id: str
) -> dict[str, set[str]] | None:
    """Mark the worker left and hand its work over, in one transaction; returns worker id →
    targets to wake it for, or None when beat declared the worker dead first (then beat has
    moved, or will move, everything)."""
    now = clock.now()
    with database.transaction() as db:
        if not workers.leave(db, worker_id, now):
            return None
        held = set(
            db.scalars(select(TrainingRun.id).where(TrainingRun.worker_id == worker_id))
        ) | set(
            db.scalars(select(SamplingSession.id).where(SamplingSession.worker_id == worker_id))
        )
        oplog.requeue_held_by(db, [worker_id])
        runs.unpin(db, [worker_id])
        wake: dict[str, set[str]] = {}
        for target in sorted(oplog.queued_targets(db, held)):
            placed_on = place(db, settings, now, target)
            if placed_on is not None:
                wake.setdefault(placed_on, set()).add(target)
    log.info(
        "worker %s left: %d runs and samplers handed over, %d with queued work placed on %s",
        worker_id,
        len(held),
        sum(len(targets) for targets in wake.values()),
        ", ".join(sorted(wake)) or "no live worker (they wait for one serving their model)",
    )
    return wake
