"""Retention of a process's S3 artifact cache: copies of artifacts no row names any more (an
ended run's snapshot, one never recorded), abandoned staging folders and partial downloads go
once untouched for the grace; copies of named artifacts (versions, a live run's snapshot,
tokenizers) and anything recent stay, and a second pass removes nothing."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from core import checkpoints, runs, sessions
from core.objectstore import LocalArtifactStore, S3ArtifactStore
from core.settings import Settings
from core.tables import TrainingRun
from scheduler import artifact_cache
from scheduler.served import tokenizer_key
from tests.scheduling import MODEL, Rows, migrated
from tests.server import AppFactory

pytestmark = pytest.mark.integration

GRACE = 3600.0


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    """One database: the job reads three columns, whose writes the other tests cover on both."""
    return sqlite_url


@pytest.fixture
def rows(database_url: str) -> Rows:
    return Rows(migrated(database_url))


@pytest.fixture
def store(s3_artifact_url: str, tmp_path: Path) -> Iterator[S3ArtifactStore]:
    yield S3ArtifactStore(s3_artifact_url, tmp_path / "artifact-cache")


def _publish(store: S3ArtifactStore, key: str, data: bytes = b"weights") -> str:
    """Write and upload a one-file artifact; its copy stays in the cache. Returns its URI."""
    (store.local_dir(key) / "adapter.bin").write_bytes(data)
    return store.publish(key)


def _age(folder: Path, seconds: float) -> None:
    """Make `folder` and everything in it look untouched for `seconds`."""
    then = time.time() - seconds
    for entry in [*folder.rglob("*"), folder]:
        os.utime(entry, (then, then))


def _cache(store: S3ArtifactStore) -> set[str]:
    return {
        f"{area}/{entry.name}"
        for area in ("objects", "staging")
        for entry in (store.cache / area).glob("*")
    }


def _copy(store: S3ArtifactStore, uri: str) -> str:
    return f"objects/{artifact_cache._copy_name(uri)}"


def _end(rows: Rows, run_id: str) -> None:
    """Unload the run and end its session: it never runs again."""
    with rows.database.transaction() as db:
        run = db.get(TrainingRun, run_id)
        assert run is not None
        runs.unload(run)
        sessions.finish(
            db,
            rows.clock,
            tenant_id=run.tenant_id,
            session_id=run.session_id,
            reason="done",
            detail=None,
            ttl_seconds=3600,
        )


def _snapshot(rows: Rows, run_id: str, uri: str) -> None:
    with rows.database.transaction() as db:
        run = db.get(TrainingRun, run_id)
        assert run is not None
        runs.record_snapshot(run, 1, uri)


def test_trimming_removes_exactly_what_nothing_reads_once_old(
    rows: Rows, store: S3ArtifactStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(data_dir=tmp_path / "data", models=[MODEL])
    tenant = rows.tenant()
    live, ended, saver = rows.run(tenant), rows.run(tenant), rows.run(tenant)
    rows.worker("w1", [MODEL, "other/model"])

    live_snapshot = _publish(store, f"{tenant}/{live}/snapshots/1")
    _snapshot(rows, live, live_snapshot)
    ended_snapshot = _publish(store, f"{tenant}/{ended}/snapshots/1", b"x" * 1000)
    _snapshot(rows, ended, ended_snapshot)
    _end(rows, ended)
    # Published but never recorded (its worker died), or an older snapshot another worker
    # replaced: no row names it.
    unnamed = _publish(store, f"{tenant}/{live}/snapshots/0", b"y" * 100)
    unnamed_recent = _publish(store, f"{tenant}/{live}/snapshots/2")
    version_uri = _publish(store, f"{tenant}/{saver}/training/step-1")
    with rows.database.transaction() as db:
        run = db.get(TrainingRun, saver)
        assert run is not None
        checkpoints.begin_upload(
            db, rows.clock, run=run, kind="training", name="step-1", artifact_uri=version_uri
        )
    tokenizers = [_publish(store, tokenizer_key(m)) for m in (MODEL, "other/model")]
    abandoned_save = store.local_dir(f"{tenant}/{saver}/training/step-9")
    (abandoned_save / "adapter.bin").write_bytes(b"z" * 10)
    writing_save = store.local_dir(f"{tenant}/{saver}/training/step-10")
    partial = store.cache / "objects" / "0123abcd.feed.partial"
    (partial / "sub").mkdir(parents=True)
    (partial / "sub" / "file").write_bytes(b"p" * 5)
    recent_partial = store.cache / "objects" / "4567cdef.beef.partial"
    recent_partial.mkdir()

    recent = {
        _copy(store, unnamed_recent),
        "staging/" + writing_save.name,
        "objects/" + recent_partial.name,
    }
    for entry in _cache(store) - recent:
        _age(store.cache / entry, 2 * GRACE)
    before = _cache(store)

    with caplog.at_level(logging.INFO, logger=artifact_cache.__name__):
        trimmed = artifact_cache.trim(rows.database, store, settings, grace_seconds=GRACE)

    gone = {
        _copy(store, ended_snapshot),
        _copy(store, unnamed),
        "staging/" + abandoned_save.name,
        "objects/" + partial.name,
    }
    assert _cache(store) == before - gone
    assert {_copy(store, uri) for uri in (live_snapshot, version_uri, *tokenizers)} <= _cache(store)
    assert trimmed == artifact_cache.Trimmed(copies=2, abandoned=2, bytes=1000 + 100 + 10 + 5)
    assert [r.getMessage() for r in caplog.records if r.name == artifact_cache.__name__] == [
        f"artifact cache {store.cache}: removed 2 copies of artifacts nothing names and "
        "2 abandoned uploads or downloads, 1115 bytes"
    ]
    assert artifact_cache.trim(rows.database, store, settings, grace_seconds=GRACE) == (
        artifact_cache.Trimmed()
    )
    # What stayed because it is recent goes once it is as old (its writer never came back).
    for entry in recent:
        _age(store.cache / entry, 2 * GRACE)
    assert artifact_cache.trim(
        rows.database, store, settings, grace_seconds=GRACE
    ) == artifact_cache.Trimmed(copies=1, abandoned=2, bytes=len(b"weights"))


def test_a_folder_store_has_no_cache_to_trim(rows: Rows, tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path / "artifacts")
    folder = store.local_dir("t/r/snapshots/1")
    _age(folder, 2 * GRACE)
    settings = Settings(data_dir=tmp_path / "data")
    artifact_cache.run_periodic(rows.database, settings, rows.clock, store)
    assert folder.is_dir()


def test_the_server_trims_its_cache_when_it_starts(
    app_factory: AppFactory, s3_artifact_url: str, tmp_path: Path
) -> None:
    app = app_factory(artifact_url=s3_artifact_url)
    staging = app.state.treadle.store.cache / "staging" / "abandoned"
    staging.mkdir(parents=True)
    _age(staging, 2 * GRACE)
    with TestClient(app):
        deadline = time.monotonic() + 30
        while staging.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not staging.exists()
