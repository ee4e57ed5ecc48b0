"""Retention of a process's own artifact files: the local cache an S3 artifact store keeps.

With an `s3://` store every process keeps a cache on its own disk, under
`<TREADLE_DATA_DIR>/artifact-cache` (`core.objectstore.S3ArtifactStore`): `staging/` holds what a
save or snapshot writes before it is uploaded, `objects/` the copies of artifacts the process
published or downloaded, and `objects/*.partial` downloads in progress. Artifact collection
(`scheduler.artifact_gc`) removes artifacts from the bucket, and from the cache of the one
process that runs it; the copies on every other machine stay. This job, run by each process
that has such a cache, removes from its disk what nothing will read again:

- the copy of an artifact no row names any more: no model version (collection stopped naming
  it once it removed it) and no training run that may still run (an unloaded or failed run
  whose session ended never reads its snapshot again);
- a staging folder or a partial download: its save or download failed, or its process died.

Both only once nothing in them changed for `TREADLE_ARTIFACT_PENDING_GRACE_SECONDS`, so a save
whose version is not yet recorded, or a download under way, is never touched. A copy of an
artifact still named is kept, however old: it is what a reader's next load returns. A folder
store (a path or `file://`) has no cache: its files are the store itself, which collection
keeps. Two processes sharing one data folder may both run this: what goes is decided from the
database and the files' ages alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import shutil
import threading
import time
from pathlib import Path

from sqlalchemy import and_, not_, select

from core.clock import Clock
from core.db import Database
from core.objectstore import ArtifactStore, S3ArtifactStore
from core.periodic import due
from core.settings import Settings
from core.tables import ModelVersion, RunStatus, Session, SessionStatus, TrainingRun, Worker
from scheduler.served import tokenizer_key

log = logging.getLogger(__name__)

EVERY_SECONDS = 600.0
"""How often the periodic job runs: the grace is an hour, so minutes late is nothing."""
PARTIAL = ".partial"
"""How the store names a download in progress (`<copy>.<random>.partial`)."""


@dataclasses.dataclass(frozen=True)
class Trimmed:
    copies: int = 0
    abandoned: int = 0
    bytes: int = 0


def trim(
    database: Database, store: S3ArtifactStore, settings: Settings, *, grace_seconds: float
) -> Trimmed:
    """One pass over `store`'s cache; returns what it removed (all zeros when run again)."""
    cutoff = time.time() - grace_seconds
    named = {_copy_name(uri) for uri in _named_uris(database, store, settings)}
    copies = abandoned = size = 0
    for folder in sorted((store.cache / "objects").glob("*")):
        is_copy = not folder.name.endswith(PARTIAL)
        if is_copy and folder.name in named:
            continue
        removed = _remove_if_idle(folder, cutoff)
        if removed is not None:
            copies, abandoned = copies + is_copy, abandoned + (not is_copy)
            size += removed
    for folder in sorted((store.cache / "staging").glob("*")):
        removed = _remove_if_idle(folder, cutoff)
        if removed is not None:
            abandoned, size = abandoned + 1, size + removed
    trimmed = Trimmed(copies, abandoned, size)
    if trimmed != Trimmed():
        log.info(
            "artifact cache %s: removed %d copies of artifacts nothing names and %d abandoned "
            "uploads or downloads, %d bytes",
            store.cache,
            copies,
            abandoned,
            size,
        )
    return trimmed


def _named_uris(database: Database, store: S3ArtifactStore, settings: Settings) -> set[str]:
    """Every artifact a process may still read: versions', live runs' snapshots, tokenizers."""
    ended = and_(
        TrainingRun.status.in_((RunStatus.UNLOADED, RunStatus.FAILED)),
        Session.status != SessionStatus.ACTIVE,
    )
    with database.reader() as db:
        versions = db.scalars(
            select(ModelVersion.artifact_uri).where(ModelVersion.artifact_uri.is_not(None))
        ).all()
        snapshots = db.scalars(
            select(TrainingRun.snapshot_uri)
            .join(Session, Session.id == TrainingRun.session_id)
            .where(TrainingRun.snapshot_uri.is_not(None), not_(ended))
        ).all()
        registered = db.scalars(select(Worker.models)).all()
    models = {*settings.models, *(entry["name"] for served in registered for entry in served)}
    tokenizers = {store.uri(tokenizer_key(model)) for model in models}
    return {uri for uri in (*versions, *snapshots) if uri is not None} | tokenizers


def _copy_name(uri: str) -> str:
    """The name of the cached copy of `uri` under `objects/` (as the store names it)."""
    return hashlib.sha256(uri.encode()).hexdigest()


def _remove_if_idle(folder: Path, cutoff: float) -> int | None:
    """Remove `folder` if nothing in it changed since `cutoff`; returns the bytes it held, or
    None when it was kept (or was already gone)."""
    try:
        entries = [folder, *folder.rglob("*")]
        stats = [entry.stat() for entry in entries]
    except FileNotFoundError:  # removed meanwhile: by its writer, or another process's pass
        return None
    if max(stat.st_mtime for stat in stats) >= cutoff:
        return None
    size = sum(stat.st_size for entry, stat in zip(entries, stats, strict=True) if entry.is_file())
    shutil.rmtree(folder, ignore_errors=True)
    return size


def run_periodic(
    database: Database, settings: Settings, clock: Clock, store: ArtifactStore
) -> None:
    """Trim `store`'s cache if EVERY_SECONDS passed since this process last did; a store without
    a cache has nothing to trim. A failure is logged and retried at the next interval."""
    if not isinstance(store, S3ArtifactStore):
        return
    if not due("artifact_cache", database, clock.now(), EVERY_SECONDS):
        return
    try:
        trim(database, store, settings, grace_seconds=settings.artifact_pending_grace_seconds)
    except Exception:
        log.exception("trimming the artifact cache failed; retrying next interval")


def keep_trimmed(
    stop: threading.Event,
    database: Database,
    settings: Settings,
    clock: Clock,
    store: ArtifactStore,
) -> None:
    """A worker process's thread: trim now, then every EVERY_SECONDS until `stop` is set."""
    while True:
        run_periodic(database, settings, clock, store)
        if stop.wait(EVERY_SECONDS):
            return
