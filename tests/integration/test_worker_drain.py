"""A worker's way out, called directly on each database: asked to drain, it keeps what is
placed on it but gets nothing new; it renews its lease until it leaves; a lapsed drain is a
death like any other; registering again makes it live."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from core.settings import Settings
from core.tables import TrainingRun, Worker, WorkerStatus
from scheduler import workers
from scheduler.placement import place
from tests.builders import make_settings
from tests.scheduling import MODEL, Rows, migrated

pytestmark = pytest.mark.integration


@pytest.fixture
def rows(database_url: str) -> Rows:
    return Rows(migrated(database_url))


@pytest.fixture
def settings(tmp_path: Path, database_url: str) -> Settings:
    return make_settings(tmp_path, database_url)


def _place(rows: Rows, settings: Settings, target_id: str) -> str | None:
    with rows.database.transaction() as db:
        return place(db, settings, rows.clock.now(), target_id)


def _worker(rows: Rows, worker_id: str) -> Worker:
    with rows.database.reader() as db:
        worker = db.get(Worker, worker_id)
        assert worker is not None
        return worker


def _renew(rows: Rows, worker_id: str) -> WorkerStatus | None:
    with rows.database.transaction() as db:
        return workers.renew(
            db,
            worker_id,
            lease_until=rows.clock.now() + timedelta(seconds=15),
            held_runs=1,
            adapter_bytes=10,
        )


def test_a_draining_worker_keeps_its_runs_and_gets_no_new_ones(
    rows: Rows, settings: Settings
) -> None:
    rows.worker("w1", [MODEL])
    tenant = rows.tenant()
    kept = rows.run(tenant)
    assert _place(rows, settings, kept) == "w1"
    with rows.database.transaction() as db:
        workers.request_drain(db, "w1", rows.clock.now())
        workers.request_drain(db, "w1", rows.clock.now())  # asking twice is harmless
    assert _worker(rows, "w1").status == "draining"
    assert _place(rows, settings, kept) == "w1"  # still alive: nothing moves under it
    newcomer = rows.run(tenant)
    assert _place(rows, settings, newcomer) is None  # the only worker serving MODEL drains
    rows.worker("w2", [MODEL])
    assert _place(rows, settings, newcomer) == "w2"
    rows.clock.advance(10)
    assert _renew(rows, "w1") is WorkerStatus.DRAINING  # the lease goes on while it drains
    assert _worker(rows, "w1").lease_expires_at == rows.clock.now() + timedelta(seconds=15)


def test_only_a_live_worker_can_be_asked_to_drain(rows: Rows) -> None:
    rows.worker("gone", [MODEL], dead=True)
    rows.worker("silent", [MODEL], lease_seconds=5)
    rows.clock.advance(6)
    with rows.database.transaction() as db:
        with pytest.raises(LookupError, match=r"no worker has id 'nope'; .*admin workers"):
            workers.request_drain(db, "nope", rows.clock.now())
        with pytest.raises(LookupError, match=r"worker gone is dead: only a live worker"):
            workers.request_drain(db, "gone", rows.clock.now())
        with pytest.raises(LookupError, match=r"worker silent is not renewing its lease"):
            workers.request_drain(db, "silent", rows.clock.now())
    assert _worker(rows, "silent").status == "live"


def test_a_draining_worker_whose_lease_lapses_is_declared_dead(rows: Rows) -> None:
    rows.worker("w1", [MODEL], lease_seconds=5)
    with rows.database.transaction() as db:
        workers.request_drain(db, "w1", rows.clock.now())
    rows.clock.advance(6)
    with rows.database.transaction() as db:
        assert workers.declare_dead_lapsed(db, rows.clock.now()) == ["w1"]
    assert _renew(rows, "w1") is WorkerStatus.DEAD


def test_a_worker_that_left_renews_nothing_and_registering_makes_it_live_again(
    rows: Rows, settings: Settings
) -> None:
    rows.worker("w1", [MODEL])
    run = rows.run(rows.tenant())
    with rows.database.transaction() as db:
        workers.leave(db, "w1", rows.clock.now())
    left = _worker(rows, "w1")
    assert (left.status, left.left_at, left.lease_expires_at) == (
        "left",
        rows.clock.now(),
        rows.clock.now(),
    )
    rows.clock.advance(1)
    assert _renew(rows, "w1") is WorkerStatus.LEFT
    assert _worker(rows, "w1").lease_expires_at == left.lease_expires_at  # not extended
    assert _place(rows, settings, run) is None
    rows.worker("w1", [MODEL])  # restarted under its id
    back = _worker(rows, "w1")
    assert (back.status, back.left_at) == ("live", None)
    assert _place(rows, settings, run) == "w1"
    with rows.database.reader() as db:
        assert db.get(TrainingRun, run).worker_id == "w1"
