"""The price book on each database: default versions, new versions only from a whole minute at
least a minute ahead, the version in force at an event's time, and a per-process cache that
always answers as the book does."""

from __future__ import annotations

import contextlib
import random
from datetime import UTC, datetime, timedelta

import pytest

from billing import pricebook
from billing.ledger import UsageLine, record_usage
from billing.prices import PriceCache, cost_micros, earliest_effective, rate_in_force
from core.clock import FakeClock
from core.errors import InvalidInput
from tests.scheduling import MODEL, Rows, migrated

pytestmark = pytest.mark.integration

START = datetime(2026, 6, 1, 12, 0, 30, tzinfo=UTC)


@pytest.fixture
def rows(database_url: str) -> Rows:
    return Rows(migrated(database_url), FakeClock(START))


def test_defaults_price_every_model_at_tinkers_published_rates(rows: Rows) -> None:
    with rows.database.reader() as db:
        book = {
            (r.base_model, r.kind): (r.unit_micros, r.cached_unit_micros)
            for r in pricebook.prices_in_force(db, rows.clock.now())
        }
        rate = rate_in_force(db, "any/model", "sampling_prefill", rows.clock.now())
    assert book == {
        ("*", "training"): (220_000, None),
        ("*", "sampling_prefill"): (70_000, 14_000),
        ("*", "sampling_sample"): (220_000, None),
        ("*", "checkpoint"): (0, None),
        ("*", "storage"): (100_000, None),
    }
    # 400 uncached and 600 cached prefill tokens: 400 × 0.07 + 600 × 0.014 = 36.4 micro-dollars.
    assert cost_micros(rate, 1000, 600) == 36
    assert rate is not None and rate.effective_from == datetime(1970, 1, 1, tzinfo=UTC)


def test_a_version_applies_from_its_minute_and_never_to_earlier_usage(rows: Rows) -> None:
    tenant = rows.tenant()
    ops = [rows.training_op(rows.run(tenant), 1).request_id for _ in range(3)]
    with rows.database.transaction() as db:
        rate = pricebook.set_price(
            db, rows.clock, base_model=MODEL, kind="training", unit_micros=1_000_000
        )
    # Set at 12:00:30: the first whole minute at least 60 s later is 12:02.
    assert rate.effective_from == datetime(2026, 6, 1, 12, 2, tzinfo=UTC)

    def record(op_id: str, model: str = MODEL) -> int:
        with rows.database.transaction() as db:
            return record_usage(
                db,
                rows.clock,
                tenant_id=tenant,
                api_key_id=None,
                session_id=None,
                operation_id=op_id,
                base_model=model,
                lines=[UsageLine("training", 1000)],
            )

    rows.clock.advance(89)  # 12:01:59
    assert record(ops[0]) == 220  # the default "*" rate still
    rows.clock.advance(1)  # 12:02:00
    assert record(ops[1]) == 1000  # the model's own version
    assert record(ops[2], model="treadle/other") == 220  # other models keep "*"
    assert record(ops[1]) == 0  # recorded before: nothing more
    with rows.database.reader() as db:
        assert [r.id for r in pricebook.price_history(db, base_model=MODEL)] == [rate.id]


def test_versions_too_soon_or_malformed_are_refused_with_what_to_do(rows: Rows) -> None:
    soonest = earliest_effective(rows.clock.now())
    assert soonest == datetime(2026, 6, 1, 12, 2, tzinfo=UTC)
    cases = [
        (dict(effective_from=START - timedelta(days=1)), "too soon.*at or after 2026-06-01T12:02"),
        (dict(effective_from=soonest - timedelta(seconds=1)), "no sooner than 60 s after"),
        (dict(kind="gpu_hours"), "unknown usage kind 'gpu_hours'; use one of training"),
        (dict(unit_micros=-1), "cannot be negative"),
        (dict(cached_unit_micros=5), "only sampling_prefill has a cached rate"),
        (dict(base_model=""), "name a model, or '\\*'"),
    ]
    for change, message in cases:
        given: dict[str, object] = {
            "base_model": MODEL,
            "kind": "training",
            "unit_micros": 1,
            **change,
        }
        with pytest.raises(InvalidInput, match=message), rows.database.transaction() as db:
            pricebook.set_price(db, rows.clock, **given)  # type: ignore[arg-type]
    with rows.database.transaction() as db:
        pricebook.set_price(
            db, rows.clock, base_model=MODEL, kind="training", unit_micros=1, effective_from=soonest
        )
    with (
        pytest.raises(InvalidInput, match="already has a version effective at"),
        rows.database.transaction() as db,
    ):
        pricebook.set_price(
            db, rows.clock, base_model=MODEL, kind="training", unit_micros=2, effective_from=soonest
        )


def test_the_cache_answers_as_the_book_while_versions_are_added(rows: Rows) -> None:
    """Prices set at random moments with random (allowed) effective times, looked up at every
    step by a cache and by the book: they never differ."""
    rng = random.Random(7)
    cache = PriceCache(rows.clock)
    models = (MODEL, "treadle/tiny-10m", "elsewhere/x")
    kinds = ("training", "sampling_prefill", "storage")
    lookups = 0
    for _ in range(400):
        rows.clock.advance(rng.choice((0.5, 2, 5, 10, 20, 29, 31, 200)))
        if rng.random() < 0.3:
            soonest = earliest_effective(rows.clock.now())
            with contextlib.suppress(InvalidInput), rows.database.transaction() as db:
                pricebook.set_price(  # refused only when that minute already has a version
                    db,
                    rows.clock,
                    base_model=rng.choice((*models, "*")),
                    kind=rng.choice(kinds),
                    unit_micros=rng.randint(0, 10**6),
                    effective_from=soonest + timedelta(minutes=rng.choice((0, 0, 1, 5))),
                )
        now = rows.clock.now()
        with rows.database.reader() as db:
            for model in models:
                for kind in kinds:
                    assert cache(db, model, kind, now) == rate_in_force(db, model, kind, now)
                    lookups += 1
    with rows.database.reader() as db:
        assert len(pricebook.price_history(db)) > 80  # the defaults and many versions
    assert lookups == 400 * 9
