"""Bringing a training run back onto an engine: its latest snapshot, then the op log after it.

Needed when a worker is asked to run an op for a run it does not hold: the run moved here
after its worker died, or an embedded server restarted. Replay changes the engine only: the
replayed ops' results were recorded (and billed) the first time and stay exactly as they were.
Snapshots are taken right after an optimizer step, when no gradients are pending, so replay
from the op after a snapshot reproduces the run's state. Op-log retention (`scheduler.retention`)
empties only payloads replay never reads; a pruned one found here fails the restore, naming it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sqlalchemy import and_, or_, select

from core.db import Database
from core.objectstore import ArtifactStore
from core.tables import Operation, OpStatus, TrainingRun
from scheduler.ops import OpKind
from scheduler.worker.claimed import Task

if TYPE_CHECKING:
    from gpu_worker.engine import Engine
    from scheduler.worker.execute import Executor

log = logging.getLogger(__name__)


class RestoreImpossible(Exception):
    """The run cannot be rebuilt; the message says why, for the failed futures."""


def restore_run(
    engine: Engine, store: ArtifactStore, database: Database, executor: Executor, run_id: str
) -> int:
    """Load the run's latest snapshot and replay what ran after it; returns ops replayed."""
    with database.reader() as db:
        run = db.get(TrainingRun, run_id)
        if run is None:
            raise RestoreImpossible(f"training run {run_id} no longer exists")
        start = run.snapshot_seq_id if run.snapshot_uri else -1
        snapshot_uri = run.snapshot_uri
        ops = db.scalars(
            select(Operation)
            .where(
                Operation.target_id == run_id,
                or_(
                    Operation.status == OpStatus.DONE,
                    # A step that failed for the user's reasons may have discarded gradients
                    # (refused after a failed forward_backward, or not finite): replay it too.
                    and_(
                        Operation.status == OpStatus.FAILED,
                        Operation.kind == OpKind.OPTIM_STEP.value,
                        Operation.error_category == "user",
                        Operation.started_at.is_not(None),
                    ),
                ),
                Operation.seq_id > start,
                Operation.seq_id <= run.executed_seq_id,
            )
            .order_by(Operation.seq_id)
        ).all()
        pruned = next((op for op in ops if op.payload_pruned_at is not None), None)
        if pruned is not None:
            # Retention empties only what replay never reads: reaching this is a server fault.
            log.error(
                "cannot restore %s: the payload of operation %s (%s, seq %s) it must replay "
                "was pruned at %s",
                run_id,
                pruned.id,
                pruned.kind,
                pruned.seq_id,
                pruned.payload_pruned_at,
            )
            raise RestoreImpossible(
                f"training run {run_id} cannot be restored: the request of operation "
                f"{pruned.id} ({pruned.kind}, seq_id {pruned.seq_id}) that it must replay was "
                "pruned from the op log; this is a server fault, report it to the operator and "
                "create a new training client from your last checkpoint"
            )
        tasks = [Task.of(op, run.base_model) for op in ops]
    if snapshot_uri is not None:
        try:
            engine.load_state(run_id, store.open_dir(snapshot_uri), include_optimizer=True)
        except FileNotFoundError as exc:
            raise RestoreImpossible(
                f"the snapshot of {run_id} is missing from the artifact store"
            ) from exc
    elif not tasks or tasks[0].seq_id != 0:
        raise RestoreImpossible(
            f"training run {run_id} was lost with its worker and has no snapshot to restore from; "
            "create a new training client from your last checkpoint"
        )
    for task in tasks:
        executor.replay(task)
    log.info(
        "restored %s from %s and replayed %d ops",
        run_id,
        "a snapshot" if snapshot_uri else "its creation",
        len(tasks),
    )
    return len(tasks)
