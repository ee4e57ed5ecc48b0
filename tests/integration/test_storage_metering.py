"""Checkpoint storage metering on each database: one priced event per tenant per ended hour,
weighted by the share of the hour each checkpoint was held, idempotent on re-runs, caught up
after a pause, and added to the rollups and the period's spend."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from billing import jobs
from billing.prices import ANY_MODEL, cost_micros, rate_in_force
from billing.rollups import rollup_totals
from billing.spend import period_spend
from billing.storage import CATCH_UP, meter_storage
from billing.tables import Price, UsageEvent
from core import checkpoints
from core.clock import FakeClock
from core.tables import TrainingRun
from tests.builders import make_settings
from tests.scheduling import Rows, migrated

pytestmark = pytest.mark.integration

GB = 10**9
START = datetime(2026, 3, 10, 9, 30, tzinfo=UTC)


@pytest.fixture
def rows(database_url: str) -> Rows:
    return Rows(migrated(database_url), FakeClock(START))


def _save(rows: Rows, run_id: str, name: str, size: int, ttl: int | None = None) -> str:
    with rows.database.transaction() as db:
        run = db.get(TrainingRun, run_id)
        assert run is not None
        return (
            checkpoints.register(
                db,
                rows.clock,
                run=run,
                kind="training",
                name=name,
                artifact_uri=f"file:///x/{name}",
                size_bytes=size,
                sha256="0" * 64,
                ttl_seconds=ttl,
            ).tinker_path
            or ""
        )


def _meter(rows: Rows) -> list[tuple[str, datetime, int]]:
    with rows.database.transaction() as db:
        return [(m.tenant_id, m.hour, m.byte_hours) for m in meter_storage(db, rows.clock)]


def _events(rows: Rows, tenant_id: str) -> dict[datetime, tuple[int, int | None, int]]:
    with rows.database.reader() as db:
        return {
            e.hour: (e.quantity, e.price_id, e.amount_micros)
            for e in db.scalars(
                select(UsageEvent).where(
                    UsageEvent.tenant_id == tenant_id, UsageEvent.kind == "storage"
                )
            )
        }


def _hour(h: int) -> datetime:
    return datetime(2026, 3, 10, h, tzinfo=UTC)


def test_hours_are_metered_once_with_the_held_share(rows: Rows) -> None:
    tenant, other = rows.tenant(), rows.tenant()
    run = rows.run(tenant)
    _save(rows, run, "a", 2 * GB)  # at 09:30: half of hour 9
    rows.clock.advance(30 * 60)  # 10:00
    assert _meter(rows) == [(tenant, _hour(9), GB)]
    rows.clock.advance(2 * 3600 + 60)  # 12:01
    metered = _meter(rows)
    assert metered == [(tenant, _hour(10), 2 * GB), (tenant, _hour(11), 2 * GB)]
    assert _meter(rows) == []  # a re-run finds every ended hour metered
    events = _events(rows, tenant)
    assert sorted(events) == [_hour(9), _hour(10), _hour(11)]
    assert _events(rows, other) == {}
    with rows.database.reader() as db:
        rate = rate_in_force(db, ANY_MODEL, "storage", _hour(10))
        assert rate is not None and rate.unit_micros > 0, "migrations seed a storage price"
        assert events[_hour(10)] == (2 * GB, rate.id, cost_micros(rate, 2 * GB))
        total = sum(amount for _, _, amount in events.values())
        assert total > 0
        rolled = rollup_totals(db, tenant, group_by=("kind",))
        assert [(t.group, t.quantity, t.amount_micros) for t in rolled] == [
            ({"kind": "storage"}, 5 * GB, total)
        ]
        assert period_spend(db, tenant, _hour(11)) == total


def test_deleted_and_expired_checkpoints_stop_accruing(rows: Rows) -> None:
    tenant = rows.tenant()
    run = rows.run(tenant)
    rows.clock.advance(30 * 60)  # 10:00
    path = _save(rows, run, "kept", GB)
    _save(rows, run, "doomed", 4 * GB)
    _save(rows, run, "short", 3 * GB, ttl=3600 + 15 * 60)  # expires 11:15
    rows.clock.advance(3600)  # 11:00
    assert _meter(rows) == [(tenant, _hour(10), 8 * GB)]
    with rows.database.transaction() as db:
        version = checkpoints.find_by_path(db, path.replace("/kept", "/doomed"))
        assert version is not None
        checkpoints.mark_deleted(version)
    rows.clock.advance(2 * 3600)  # 13:00
    # Hour 11: 1 GB kept, the 3 GB one for a quarter; hour 12: the kept one alone.
    assert _meter(rows) == [
        (tenant, _hour(11), GB + 3 * GB // 4),
        (tenant, _hour(12), GB),
    ]


def test_versions_sharing_an_artifact_bill_its_bytes_once(rows: Rows) -> None:
    tenant = rows.tenant()
    run = rows.run(tenant)
    _save(rows, run, "a", 2 * GB, ttl=3600)  # 09:30 to 10:30
    rows.clock.advance(15 * 60)  # 09:45: a copy on the same files, as promotion makes one
    with rows.database.transaction() as db:
        checkpoints.register(
            db, rows.clock, run=db.get(TrainingRun, run), kind="training", name=None,  # type: ignore[arg-type]
            artifact_uri="file:///x/a", size_bytes=2 * GB, sha256="0" * 64, ttl_seconds=3600,
        )  # fmt: skip
    rows.clock.advance(2 * 3600)  # 11:45
    # Hour 9: the artifact from 09:30 (half the hour); hour 10: until the copy expires at 10:45,
    # held by both until 10:30, yet counted once.
    assert _meter(rows) == [(tenant, _hour(9), GB), (tenant, _hour(10), 3 * GB // 2)]


def test_missed_hours_are_caught_up_within_the_bound(rows: Rows) -> None:
    tenant = rows.tenant()
    _save(rows, rows.run(tenant), "a", GB)
    rows.clock.advance(30 * 60 + 72 * 3600)  # three days later, on the hour: nothing ran
    metered = _meter(rows)
    hours = CATCH_UP // timedelta(hours=1)
    assert len(metered) == hours
    now = rows.clock.now()
    assert [hour for _, hour, _ in metered] == [
        now - timedelta(hours=hours - i) for i in range(hours)
    ]
    assert {quantity for _, _, quantity in metered} == {GB}


def test_a_price_change_prices_later_hours(rows: Rows) -> None:
    tenant = rows.tenant()
    _save(rows, rows.run(tenant), "a", GB)
    with rows.database.transaction() as db:
        db.add(
            Price(
                base_model=ANY_MODEL,
                kind="storage",
                unit_micros=730_000_000,  # $730 per GB-month: $1 per GB-hour
                cached_unit_micros=None,
                effective_from=_hour(11),
                created_at=rows.clock.now(),
                created_by="test",
            )
        )
    rows.clock.advance(30 * 60 + 2 * 3600)  # 12:00
    _meter(rows)
    events = _events(rows, tenant)
    assert events[_hour(11)][2] == 1_000_000
    assert events[_hour(10)][2] < 1_000_000


def test_run_periodic_meters_at_most_once_per_interval(rows: Rows, tmp_path: Path) -> None:
    tenant = rows.tenant()
    _save(rows, rows.run(tenant), "a", GB)
    settings = make_settings(tmp_path, rows.database.url, storage_meter_seconds=600)
    rows.clock.advance(30 * 60)  # 10:00
    jobs.run_periodic(rows.database, settings, rows.clock)
    assert sorted(_events(rows, tenant)) == [_hour(9)]
    rows.clock.advance(3600 + 58 * 60)  # 11:58
    jobs.run_periodic(rows.database, settings, rows.clock)
    assert sorted(_events(rows, tenant)) == [_hour(9), _hour(10)]
    rows.clock.advance(3 * 60)  # 12:01: hour 11 has ended, but the last run was 3 min ago
    jobs.run_periodic(rows.database, settings, rows.clock)
    assert sorted(_events(rows, tenant)) == [_hour(9), _hour(10)]
    rows.clock.advance(8 * 60)  # 12:09
    jobs.run_periodic(rows.database, settings, rows.clock)
    assert sorted(_events(rows, tenant)) == [_hour(9), _hour(10), _hour(11)]
