"""Placement, called directly on each database: which live worker holds a run or a sampler.

A target goes to the least-loaded live worker serving its base model (aliases resolved), keeps
a live holder, moves when its holder dies, and waits (None) while no worker can take it. A
nameless sampler of a training run goes where the run is while that worker lives.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from core.settings import Settings
from core.tables import SamplingSession, TrainingRun
from scheduler.beat import reap_dead_workers
from scheduler.dispatch import CeleryDispatcher
from scheduler.placement import choose_worker, place
from scheduler.worker.embedded import EmbeddedDispatcher
from scheduler.workers import live as live_workers
from tests.builders import make_settings
from tests.scheduling import MODEL, Rows, migrated

pytestmark = pytest.mark.integration

OTHER = "other/model"
ALIAS = "Qwen/Qwen3-8B"
LEASE = 15.0


@pytest.fixture
def rows(database_url: str) -> Rows:
    return Rows(migrated(database_url))


@pytest.fixture
def settings(tmp_path: Path, database_url: str) -> Settings:
    return make_settings(tmp_path, database_url, model_aliases={ALIAS: MODEL})


def _place(rows: Rows, settings: Settings, target_id: str) -> str | None:
    with rows.database.transaction() as db:
        return place(db, settings, rows.clock.now(), target_id)


def _holder(rows: Rows, target_id: str) -> str | None:
    with rows.database.reader() as db:
        run = db.get(TrainingRun, target_id)
        if run is not None:
            return run.worker_id
        sampler = db.get(SamplingSession, target_id)
        assert sampler is not None
        return sampler.worker_id


def test_runs_go_to_the_least_loaded_live_worker_serving_their_model(
    rows: Rows, settings: Settings
) -> None:
    tenant = rows.tenant()
    rows.worker("w-0", [OTHER])  # first by id and idle, but serves another model
    rows.worker("w-a", [MODEL])
    first = rows.run(tenant)
    assert _place(rows, settings, first) == "w-a"
    rows.worker("w-b", [OTHER, MODEL])
    placed = [_place(rows, settings, rows.run(tenant)) for _ in range(3)]
    # w-b is empty, then both hold one (the tie goes to the first id), then w-b holds fewer.
    assert placed == ["w-b", "w-a", "w-b"]
    assert _holder(rows, first) == "w-a"  # placement is stored on the run


def test_an_alias_is_placed_on_a_worker_serving_the_model_it_names(
    rows: Rows, settings: Settings
) -> None:
    rows.worker("w-a", [OTHER])
    rows.worker("w-b", [MODEL])
    run = rows.run(rows.tenant(), base_model=ALIAS)
    assert _place(rows, settings, run) == "w-b"
    with rows.database.reader() as db:
        assert choose_worker(db, settings, rows.clock.now(), ALIAS) == "w-b"
        assert choose_worker(db, settings, rows.clock.now(), MODEL) == "w-b"


def test_a_worker_group_takes_runs_by_its_load_per_rank(rows: Rows, settings: Settings) -> None:
    tenant = rows.tenant()
    rows.worker("w-1", [MODEL])
    rows.worker("w-4", [MODEL], group_size=4)
    placed = [_place(rows, settings, rows.run(tenant)) for _ in range(7)]
    # Both idle: the larger group. Then runs per rank: 1/4 > 0, 1/4 < 1 three times, then
    # 4/4 = 1 ties (the larger group again), and 5/4 > 1.
    assert placed == ["w-4", "w-1", "w-4", "w-4", "w-4", "w-4", "w-1"]


def test_a_model_needing_several_devices_goes_to_groups_that_large_while_any_lives(
    rows: Rows, settings: Settings
) -> None:
    tenant = rows.tenant()
    # w-0 registers the model as one device (configured without TREADLE_MODEL_DEVICES): the
    # group registering it with two says what it needs.
    rows.worker("w-0", [MODEL, OTHER])
    rows.worker("w-2", [MODEL], group_size=2, devices={MODEL: 2})
    rows.worker("w-4", [MODEL], group_size=4, devices={MODEL: 2})
    placed = [_place(rows, settings, rows.run(tenant)) for _ in range(3)]
    assert placed == ["w-4", "w-2", "w-4"]
    assert _place(rows, settings, rows.run(tenant, base_model=OTHER)) == "w-0"
    with rows.database.reader() as db:
        # by its alias too; 2 runs on 4 ranks tie with 1 on 2: the larger group
        assert choose_worker(db, settings, rows.clock.now(), ALIAS) == "w-4"
    rows.worker("w-2", [MODEL], group_size=2, devices={MODEL: 2}, dead=True)
    rows.worker("w-4", [MODEL], group_size=4, devices={MODEL: 2}, dead=True)
    # Only w-0 is left, and it loaded the model: what the live workers registered is what
    # the model needs, so w-0 serves it now.
    assert _place(rows, settings, rows.run(tenant)) == "w-0"


def test_dead_and_lapsed_workers_are_skipped(rows: Rows, settings: Settings) -> None:
    rows.worker("w-a", [MODEL], dead=True)
    rows.worker("w-b", [MODEL], lease_seconds=-1)
    rows.worker("w-c", [MODEL], lease_seconds=0)  # a lease ends at its expiry time
    rows.worker("w-d", [MODEL])
    with rows.database.reader() as db:
        assert [w.id for w in live_workers(db, rows.clock.now())] == ["w-d"]
    assert _place(rows, settings, rows.run(rows.tenant())) == "w-d"


def test_a_run_keeps_a_live_holder_however_loaded(rows: Rows, settings: Settings) -> None:
    tenant = rows.tenant()
    rows.worker("w-a", [MODEL])
    held = rows.run(tenant)
    assert _place(rows, settings, held) == "w-a"
    assert _place(rows, settings, rows.run(tenant)) == "w-a"
    rows.worker("w-b", [MODEL])  # idle, while w-a holds two runs
    assert _place(rows, settings, held) == "w-a"
    assert _holder(rows, held) == "w-a"


def test_a_run_whose_holder_lapsed_or_died_is_placed_again(rows: Rows, settings: Settings) -> None:
    tenant = rows.tenant()
    rows.worker("w-a", [MODEL])
    lapsed, reaped = rows.run(tenant), rows.run(tenant)
    assert [_place(rows, settings, run) for run in (lapsed, reaped)] == ["w-a", "w-a"]
    rows.clock.advance(LEASE + 1)  # w-a stops renewing its lease
    rows.worker("w-b", [MODEL])
    # Before the beat reaps w-a, placement already sees its lease lapsed.
    assert _place(rows, settings, lapsed) == "w-b"
    assert reap_dead_workers(rows.database, settings, rows.clock) == ["w-a"]
    assert _holder(rows, reaped) is None  # the reaper unpins it
    assert _place(rows, settings, reaped) == "w-b"


def test_nothing_is_placed_while_no_live_worker_serves_the_model(
    rows: Rows, settings: Settings
) -> None:
    tenant = rows.tenant()
    run, sampler = rows.run(tenant), rows.sampler(tenant)
    assert _place(rows, settings, run) is None  # no workers at all
    rows.worker("w-a", [OTHER])
    rows.worker("w-b", [MODEL], dead=True)
    assert _place(rows, settings, run) is None
    assert _place(rows, settings, sampler) is None
    assert _holder(rows, run) is None and _holder(rows, sampler) is None
    assert _place(rows, settings, "no-such-target") is None
    rows.worker("w-c", [MODEL])
    assert _place(rows, settings, run) == "w-c"  # it waited, and now goes


def test_a_live_sampler_goes_where_its_training_run_is_and_follows_it(
    rows: Rows, settings: Settings
) -> None:
    tenant = rows.tenant()
    rows.worker("w-a", [MODEL])
    run = rows.run(tenant)
    assert [_place(rows, settings, r) for r in (run, rows.run(tenant))] == ["w-a", "w-a"]
    rows.worker("w-b", [MODEL])  # the least loaded from here on
    live = rows.sampler(tenant, training_run_id=run)
    plain = rows.sampler(tenant)
    assert _place(rows, settings, live) == "w-a"
    assert _place(rows, settings, plain) == "w-b"

    rows.clock.advance(LEASE + 1)
    rows.worker("w-c", [MODEL])  # w-a and w-b lapse; w-c is the only live worker
    # The run's worker is gone: placing its live sampler places the run first, and the
    # sampler goes with it, so that its samples run where the run's weights are.
    assert _place(rows, settings, live) == "w-c"
    assert _holder(rows, run) == "w-c"
    later = rows.sampler(tenant, training_run_id=run, seq=1)
    assert _place(rows, settings, later) == "w-c"


def test_assign_places_inside_the_submitting_transaction(
    rows: Rows, tmp_path: Path, database_url: str
) -> None:
    """The distributed dispatcher places through `place`, in the caller's transaction: the
    placement commits with the submission, or not at all. The embedded one places nothing."""
    settings = make_settings(tmp_path, database_url, redis_url="redis://127.0.0.1:1")
    dispatcher = CeleryDispatcher(settings, rows.clock)  # connects only to send a wake-up
    tenant = rows.tenant()
    rows.worker("w-a", [MODEL])
    run = rows.run(tenant)
    with pytest.raises(RuntimeError), rows.database.transaction() as db:
        assert dispatcher.assign(db, run) == "w-a"
        raise RuntimeError("the submission failed")
    assert _holder(rows, run) is None
    with rows.database.transaction() as db:
        assert dispatcher.assign(db, run) == "w-a"
        assert EmbeddedDispatcher(lambda: pytest.fail("never built")).assign(db, run) is None
    assert _holder(rows, run) == "w-a"
    with rows.database.reader() as db:
        holders = db.scalars(select(TrainingRun.worker_id).where(TrainingRun.tenant_id == tenant))
        assert list(holders) == ["w-a"]
