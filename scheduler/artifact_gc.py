"""Artifact collection: remove from the artifact store what no version or run needs any more.

A periodic job, run by beat in distributed mode and by the embedded server, in three steps:

1. a version pending for longer than `TREADLE_ARTIFACT_PENDING_GRACE_SECONDS` lost its uploader
   (a worker killed mid-upload): it is marked failed;
2. the artifact of a deleted (overwritten), failed or expired version is removed once no other
   ready and unexpired, or pending, version names the same artifact (a promoted version shares
   its source's) and no run of an active session was loaded from it (recovery would replay the
   load), and every deleted, failed or expired version naming it stops naming it;
3. the snapshot of a run that never executes again (unloaded or failed, its session ended) is
   removed, and the run stops naming it. A live run's earlier snapshots are removed by its
   worker as soon as the next one is recorded.

The rows are changed only after the store's delete returned, so a crash in between leaves a row
naming a missing artifact, which the next pass removes again (deleting nothing is no error).
Every step is idempotent: a second pass, or two beats at once, changes nothing more. What a
route deletes at once (`DELETE` of a checkpoint nothing else shares) never reaches this job.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy.orm import Session as OrmSession

from core import checkpoints, runs
from core.clock import Clock
from core.db import Database
from core.objectstore import ArtifactStore, open_store
from core.periodic import due
from core.settings import Settings
from core.tables import TrainingRun

log = logging.getLogger(__name__)

BATCH = 100
"""Versions or runs handled per transaction."""
EVERY_SECONDS = 300.0
"""How often the periodic job runs."""


@dataclasses.dataclass(frozen=True)
class Collected:
    failed_uploads: int = 0
    versions: int = 0
    snapshots: int = 0


def collect(
    database: Database,
    store: ArtifactStore,
    clock: Clock,
    *,
    pending_grace: timedelta,
    batch: int = BATCH,
) -> Collected:
    """One full pass; returns what it changed (all zeros when run again)."""
    with database.transaction() as db:
        failed = checkpoints.fail_stale_uploads(db, clock, pending_grace)
    versions = _drain(
        database,
        store,
        lambda db: {v.id: v.artifact_uri for v in checkpoints.collectable(db, clock, batch)},
        lambda db, _, uri: checkpoints.forget_artifact(db, clock, uri),
        batch,
    )
    snapshots = _drain(
        database,
        store,
        lambda db: {r.id: r.snapshot_uri for r in runs.ended_with_snapshots(db, batch)},
        _forget_run_snapshot,
        batch,
    )
    collected = Collected(failed, versions, snapshots)
    if collected != Collected():
        log.info(
            "artifact collection: %d stale uploads failed, %d versions' and %d runs' "
            "artifacts removed",
            failed,
            versions,
            snapshots,
        )
    return collected


def _forget_run_snapshot(db: OrmSession, row_id: str, uri: str) -> None:
    run = db.get(TrainingRun, row_id)
    if run is not None:
        runs.forget_snapshot(run, uri)


def _drain(
    database: Database,
    store: ArtifactStore,
    find: Callable[[OrmSession], dict[str, str | None]],
    forget: Callable[[OrmSession, str, str], object],
    batch: int,
) -> int:
    """Remove the artifacts `find` names, batch by batch, and `forget` each removed one."""
    total = 0
    while True:
        with database.transaction() as db:
            found = find(db)
        removed: dict[str, str] = {}
        failed_uris: set[str] = set()
        for row_id, uri in found.items():
            if uri is None or uri in failed_uris:
                continue
            try:
                store.delete(uri)
            except Exception:
                # Kept for the next pass: the row still names it.
                log.exception("removing artifact %s failed; retrying next pass", uri)
                failed_uris.add(uri)
                continue
            removed[row_id] = uri
        if removed:
            with database.transaction() as db:
                for row_id, uri in removed.items():
                    forget(db, row_id, uri)
        total += len(removed)
        if len(found) < batch or not removed:
            return total


def run_periodic(
    database: Database, settings: Settings, clock: Clock, store: ArtifactStore | None = None
) -> None:
    """Collect if EVERY_SECONDS passed since this process last did on `database`; a failure is
    logged and retried at the next interval. Called by beat's tick (which opens the store from
    the settings) and the embedded server (with its own store)."""
    if not due("artifact_gc", database, clock.now(), EVERY_SECONDS):
        return
    try:
        collect(
            database,
            store or open_store(settings),
            clock,
            pending_grace=timedelta(seconds=settings.artifact_pending_grace_seconds),
        )
    except Exception:
        log.exception("artifact collection failed; retrying next interval")
