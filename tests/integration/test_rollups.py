"""Hourly and daily rollups and period spend stay the sums of the ledger: a randomized run of
recordings (several tenants, keys, sessions, models and kinds over many hours and UTC days,
replayed ops, a price change) leaves rollups and spend equal to direct sums over the events and
to rebuilds from them, on each database (PostgreSQL's session in a zone half an hour off UTC,
so a day cut in local time would show)."""

from __future__ import annotations

import random
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import delete, select, text, update

from billing import pricebook
from billing.ledger import UsageLine, record_usage
from billing.prices import PriceCache, cost_micros, rate_in_force
from billing.rollups import RolledEvent, add_to_rollups, recompute_rollups, rollup_totals
from billing.spend import period_spend, period_start, recompute_spend
from billing.tables import (
    NO_DIMENSION,
    USAGE_KINDS,
    DailyUsage,
    TenantSpend,
    UsageEvent,
    UsageRollup,
)
from core import apikeys
from core.clock import FakeClock
from core.db import Database
from core.tables import Tenant
from scheduler.ops import OpKind
from tests.scheduling import Rows, migrated

pytestmark = pytest.mark.integration

MODELS = ("treadle/tiny-1m", "treadle/tiny-10m")
OP_KINDS = tuple(k for k in USAGE_KINDS if k != "storage")  # storage is metered, not per op

RollupKey = tuple[str, datetime, str, str, str, str, int]
DayKey = tuple[datetime, str, str, str, str]
Sums = tuple[int, int, int, int]


@pytest.fixture
def rows(database_url: str) -> Rows:
    database = Database(database_url)
    if database.engine.dialect.name == "postgresql":
        with database.engine.begin() as conn:
            name = conn.execute(text("SELECT current_database()")).scalar_one()
            conn.execute(text(f"ALTER DATABASE \"{name}\" SET timezone TO 'Asia/Kolkata'"))
        database.engine.dispose()
    # Late in a month, so the run crosses into the next billing period.
    return Rows(migrated(database_url), FakeClock(datetime(2026, 3, 31, 20, 5, tzinfo=UTC)))


def _api_key(rows: Rows, tenant_id: str) -> str:
    with rows.database.transaction() as db:
        tenant = db.get(Tenant, tenant_id)
        assert tenant is not None
        key, _ = apikeys.issue_api_key(db, rows.clock, b"s" * 32, tenant, name="", scope="tenant")
        return key.id


def _stored_rollups(rows: Rows) -> dict[RollupKey, tuple[int, int, int, int]]:
    with rows.database.reader() as db:
        return {
            (r.tenant_id, r.hour, r.api_key_id, r.session_id, r.base_model, r.kind, r.price_id): (
                r.events,
                r.quantity,
                r.cached_quantity,
                r.amount_micros,
            )
            for r in db.scalars(select(UsageRollup))
        }


def _stored_days(rows: Rows) -> dict[DayKey, Sums]:
    with rows.database.reader() as db:
        return {
            (r.day, r.tenant_id, r.api_key_id, r.base_model, r.kind): (
                r.events,
                r.quantity,
                r.cached_quantity,
                r.amount_micros,
            )
            for r in db.scalars(select(DailyUsage))
        }


def _days_of(hours: dict[RollupKey, Sums]) -> dict[DayKey, Sums]:
    """Hourly rollups summed per UTC day, over sessions and prices."""
    sums: dict[DayKey, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for (tenant, hour, key, _session, model, kind, _price), values in hours.items():
        day = hour.astimezone(UTC).replace(hour=0)
        for i, value in enumerate(values):
            sums[(day, tenant, key, model, kind)][i] += value
    return {key: (a, b, c, d) for key, (a, b, c, d) in sums.items()}


def _ledger_sums(events: list[UsageEvent]) -> dict[RollupKey, tuple[int, int, int, int]]:
    sums: dict[RollupKey, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for e in events:
        key = (
            e.tenant_id,
            e.hour,
            e.api_key_id or NO_DIMENSION,
            e.session_id or NO_DIMENSION,
            e.base_model,
            e.kind,
            e.price_id or 0,
        )
        for i, value in enumerate((1, e.quantity, e.cached_quantity, e.amount_micros)):
            sums[key][i] += value
    return {key: (a, b, c, d) for key, (a, b, c, d) in sums.items()}


def test_rollups_and_spend_equal_the_ledger_and_its_rebuild(rows: Rows) -> None:
    rng = random.Random(20260331)
    tenants = [rows.tenant(max_queued_ops=10_000) for _ in range(3)]
    keys = {t: [_api_key(rows, t), _api_key(rows, t), None] for t in tenants}
    runs = {t: [rows.run(t), rows.run(t)] for t in tenants}
    next_seq: dict[str, int] = defaultdict(lambda: 1)
    cache = PriceCache(rows.clock)
    recorded: list[tuple[str, str, str | None, str | None, str, list[UsageLine]]] = []
    returned_total = 0
    price_changed = False

    for step in range(90):
        rows.clock.advance(rng.randint(0, 25 * 60))
        if step == 30:
            # A new training price for one model, and a new "*" sampling price, both in force
            # from the next allowed minute; later events are priced by them.
            with rows.database.transaction() as db:
                pricebook.set_price(
                    db, rows.clock, base_model=MODELS[1], kind="training", unit_micros=500_000
                )
                pricebook.set_price(
                    db,
                    rows.clock,
                    base_model="*",
                    kind="sampling_prefill",
                    unit_micros=90_000,
                    cached_unit_micros=9_000,
                )
            price_changed = True
        if recorded and rng.random() < 0.25:
            # A replay (redelivery, a crash before the ack): the same op recorded again, maybe
            # with other quantities or an extra kind; nothing already recorded counts again.
            tenant, op_id, key, session, model, lines = rng.choice(recorded)
            if rng.random() < 0.5:
                lines = [UsageLine(line.kind, line.quantity * 2) for line in lines]
        else:
            tenant = rng.choice(tenants)
            run = rng.choice(runs[tenant])
            op_id = rows.training_op(run, next_seq[run], OpKind.FORWARD_BACKWARD).request_id
            next_seq[run] += 1
            key = rng.choice(keys[tenant])
            session = None if rng.random() < 0.2 else rows.op(op_id).session_id
            model = rng.choice(MODELS)
            kinds = rng.sample(OP_KINDS, rng.randint(1, len(OP_KINDS)))
            lines = []
            for kind in kinds:
                quantity = rng.choice((0, 1, rng.randint(1, 5000)))
                cached = rng.randint(0, quantity) if kind == "sampling_prefill" else 0
                lines.append(UsageLine(kind, quantity, cached))
            recorded.append((tenant, op_id, key, session, model, lines))
        with rows.database.transaction() as db:
            returned_total += record_usage(
                db,
                rows.clock,
                tenant_id=tenant,
                api_key_id=key,
                session_id=session,
                operation_id=op_id,
                base_model=model,
                lines=lines,
                rates=cache if step % 2 else rate_in_force,
            )
    assert price_changed

    with rows.database.reader() as db:
        events = list(db.scalars(select(UsageEvent)))
        # Every event is priced at the version in force at its time, as the book says now.
        for e in events:
            rate = rate_in_force(db, e.base_model, e.kind, e.created_at)
            assert e.price_id == (None if rate is None else rate.id)
            assert e.amount_micros == cost_micros(rate, e.quantity, e.cached_quantity)
            assert e.hour == e.created_at.replace(minute=0, second=0, microsecond=0)
        spend = {
            (s.tenant_id, s.period_start): s.spent_micros for s in db.scalars(select(TenantSpend))
        }
    hours = {e.hour for e in events}
    assert len(hours) >= 10 and len({e.price_id for e in events}) >= 4
    assert len({e.api_key_id for e in events}) >= 4 and None in {e.session_id for e in events}
    assert sum(e.amount_micros for e in events) == returned_total > 0

    # Rollups equal the direct sums over the ledger, and daily rollups the hourly ones'.
    expected = _ledger_sums(events)
    assert _stored_rollups(rows) == expected
    expected_days = _days_of(expected)
    assert _stored_days(rows) == expected_days
    assert len({day for day, *_ in expected_days}) >= 2
    assert any(session != NO_DIMENSION for _, _, _, session, *_ in expected)
    assert len(expected_days) < len(expected)  # sessions, prices and hours folded

    # Spend per period equals the ledger's amounts in the period.
    by_period: dict[tuple[str, datetime], int] = defaultdict(int)
    for e in events:
        by_period[(e.tenant_id, period_start(e.hour))] += e.amount_micros
    assert spend == {k: v for k, v in by_period.items() if v}
    assert len({p for _, p in spend}) == 2  # March and April
    with rows.database.reader() as db:
        for (tenant, start), amount in by_period.items():
            assert period_spend(db, tenant, start + timedelta(days=3)) == amount
    # A rebuild of the counters from the ledger gives them back, whole or for one tenant.
    for tenant in (None, tenants[0]):
        with rows.database.transaction() as db:
            db.execute(delete(TenantSpend))
            recompute_spend(db, tenant_id=tenant)
        with rows.database.reader() as db:
            rebuilt = {
                (s.tenant_id, s.period_start): s.spent_micros
                for s in db.scalars(select(TenantSpend))
            }
        assert rebuilt == {k: v for k, v in spend.items() if tenant in (None, k[0])}

    # The readers' totals match too: per kind, per key over a window, per session.
    since, until = min(hours) + timedelta(hours=2), max(hours)
    with rows.database.reader() as db:
        for tenant in tenants:
            mine = [e for e in events if e.tenant_id == tenant]
            per_kind = {
                t.group["kind"]: (t.events, t.quantity, t.amount_micros)
                for t in rollup_totals(db, tenant)
            }
            assert per_kind == {
                kind: (
                    sum(1 for e in mine if e.kind == kind),
                    sum(e.quantity for e in mine if e.kind == kind),
                    sum(e.amount_micros for e in mine if e.kind == kind),
                )
                for kind in {e.kind for e in mine}
            }
            windowed = rollup_totals(db, tenant, since, until, group_by=("api_key_id",))
            assert {t.group["api_key_id"]: t.amount_micros for t in windowed} == {
                key or NO_DIMENSION: sum(
                    e.amount_micros
                    for e in mine
                    if since <= e.hour < until and (e.api_key_id or NO_DIMENSION) == (key or "")
                )
                for key in {e.api_key_id for e in mine if since <= e.hour < until}
            }
            session = next(e.session_id for e in mine if e.session_id)
            [total] = rollup_totals(db, tenant, group_by=(), session_id=session)
            assert total.amount_micros == sum(
                e.amount_micros for e in mine if e.session_id == session
            )

    # A rebuild from the ledger writes the same rollups, whole or for one tenant and window;
    # the daily ones of the days the window touches are rebuilt from the hourly ones.
    with rows.database.transaction() as db:
        db.execute(update(DailyUsage).values(amount_micros=DailyUsage.amount_micros + 1))
        recompute_rollups(db)
    assert _stored_rollups(rows) == expected
    assert _stored_days(rows) == expected_days
    with rows.database.transaction() as db:
        db.execute(delete(UsageRollup).where(UsageRollup.tenant_id == tenants[0]))
        db.execute(delete(DailyUsage).where(DailyUsage.tenant_id == tenants[0]))
        recompute_rollups(db, tenant_id=tenants[0], since=since, until=until)
    kept = {k: v for k, v in expected.items() if k[0] != tenants[0] or since <= k[1] < until}
    assert _stored_rollups(rows) == kept
    assert _stored_days(rows) == _days_of(kept)
    # A window starting and ending mid-day rebuilds those whole days, and no other.
    first_day = min(hours).replace(hour=0)
    window = (first_day + timedelta(hours=21), first_day + timedelta(hours=23))
    with rows.database.transaction() as db:
        db.execute(update(DailyUsage).values(events=DailyUsage.events + 1))
        recompute_rollups(db, since=window[0], until=window[1])
    rebuilt = kept | {k: v for k, v in expected.items() if window[0] <= k[1] < window[1]}
    assert _stored_rollups(rows) == rebuilt
    assert _stored_days(rows) == {
        k: v if k[0] == first_day else (v[0] + 1, *v[1:]) for k, v in _days_of(rebuilt).items()
    }


def test_events_of_one_cell_add_up_in_one_upsert(rows: Rows) -> None:
    tenant = rows.tenant()
    hour = datetime(2026, 3, 31, 20, tzinfo=UTC)
    event = RolledEvent(tenant, hour, None, None, "m", "storage", None, 10, 0, 3)
    with rows.database.transaction() as db:
        add_to_rollups(db, [event, event])
        add_to_rollups(db, [event])
        add_to_rollups(db, [])
    assert _stored_rollups(rows) == {
        (tenant, hour, NO_DIMENSION, NO_DIMENSION, "m", "storage", 0): (3, 30, 0, 9)
    }
    assert _stored_days(rows) == {
        (hour.replace(hour=0), tenant, NO_DIMENSION, "m", "storage"): (3, 30, 0, 9)
    }
