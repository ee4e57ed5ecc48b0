"""Usage reaches Stripe's meters exactly once: the real `stripe` library against a fake Stripe
on loopback, the pusher's record on each database. A push killed between Stripe's answer and
the record, a connection dropped after Stripe stored the event, a storm of 429s: each ends with
every meter event held once and Stripe's totals equal to the ledger to the micro-unit."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import SecretStr
from sqlalchemy import select

from billing import jobs, stripe_parts
from billing.stripe_gateway import RetryPolicy, StripeGateway, StripeUnavailable
from billing.stripe_parts import PendingPush
from billing.stripe_push import RESEND_WITHIN, PushReport, push_usage, running_push
from billing.stripe_reconcile import reconcile
from billing.tables import StripeMeterPush
from core.errors import NotFound
from core.settings import Settings
from tests.fakes import stripe_server
from tests.fakes.stripe_server import FakeStripe
from tests.integration.stripe_helpers import Ledger, hour_of

pytestmark = pytest.mark.integration

KINDS = ("training", "sampling_prefill", "sampling_sample")


@pytest.fixture
def ledger(database_url: str) -> Ledger:
    return Ledger(database_url)


@pytest.fixture
def fake(ledger: Ledger) -> Iterator[FakeStripe]:
    with stripe_server.running(now=ledger.clock.now) as fake:
        for kind in KINDS:
            fake.add_meter(f"treadle_{kind}")
        yield fake


def _gateway(fake: FakeStripe, delays: list[float] | None = None) -> StripeGateway:
    sink = delays if delays is not None else []
    return StripeGateway(stripe_server.API_KEY, api_base=fake.url, sleep=sink.append)


def _push(ledger: Ledger, fake: FakeStripe, **kwargs: object) -> PushReport:
    return push_usage(ledger.database, _gateway(fake), ledger.clock, **kwargs)  # type: ignore[arg-type]


def _assert_stripe_matches_ledger(ledger: Ledger, fake: FakeStripe) -> None:
    identifiers = fake.identifiers()
    assert len(identifiers) == len(set(identifiers)), "Stripe holds an event twice"
    for tenant_id, customer in ledger.customers.items():
        for kind in KINDS:
            assert fake.total(f"treadle_{kind}", customer) == ledger.settled_sum(tenant_id, kind)


def _recorded(ledger: Ledger, *, accepted: bool = True) -> list[tuple[str, int, int]]:
    """The parts recorded as accepted by Stripe, or as intended and not accepted."""
    marked = StripeMeterPush.accepted_at.is_not(None)
    with ledger.database.reader() as db:
        rows = db.scalars(
            select(StripeMeterPush)
            .where(marked if accepted else ~marked)
            .order_by(StripeMeterPush.identifier)
        )
        return [(row.identifier, row.part, row.value_micros) for row in rows]


class Killed(Exception):
    """The pushing process dies here."""


def _die_after_first_batch(accepted: list[PendingPush]) -> None:
    raise Killed(f"process killed after Stripe accepted {len(accepted)} events")


def test_settled_hours_are_pushed_once_and_equal_the_ledger(
    ledger: Ledger, fake: FakeStripe
) -> None:
    acme, globex = ledger.tenant("cus_Acme"), ledger.tenant("cus_Globex")
    unlinked = ledger.tenant(None)
    start = hour_of(ledger.clock.now())
    for hours_ago in (3, 2):
        for tenant in (acme, globex, unlinked):
            ledger.usage(tenant, "training", start - timedelta(hours=hours_ago), 1_234_567)
            ledger.usage(tenant, "sampling_sample", start - timedelta(hours=hours_ago), 89)
    ledger.usage(acme, "training", start - timedelta(hours=2), 1, price=ledger.new_price())
    # The hour just ended has not settled (10 minutes), and this hour has not ended.
    ledger.usage(acme, "training", start - timedelta(hours=1), 500)
    ledger.usage(acme, "training", start, 700)
    ledger.clock.advance(5 * 60)

    report = _push(ledger, fake)
    assert (report.pushed, report.repeats) == (9, 0)
    _assert_stripe_matches_ledger(ledger, fake)
    assert fake.total("treadle_training", "cus_Acme") == 2 * 1_234_567 + 1
    assert all(not ident.startswith(f"treadle-{unlinked}") for ident in fake.identifiers())

    # Nothing is left to push until the next hour settles; then that hour alone goes.
    assert _push(ledger, fake).pushed == 0
    ledger.clock.advance(60 * 60)
    assert _push(ledger, fake).pushed == 1
    assert fake.total("treadle_training", "cus_Acme") == 2 * 1_234_567 + 1 + 500
    _assert_stripe_matches_ledger(ledger, fake)


def test_a_push_killed_after_stripe_accepted_a_batch_bills_nothing_twice(
    ledger: Ledger, fake: FakeStripe
) -> None:
    acme = ledger.tenant("cus_Acme")
    start = hour_of(ledger.clock.now())
    for hours_ago in range(2, 7):
        ledger.usage(acme, "training", start - timedelta(hours=hours_ago), 1_000 + hours_ago)
        ledger.usage(acme, "sampling_prefill", start - timedelta(hours=hours_ago), 7 * hours_ago)

    with pytest.raises(Killed):
        _push(ledger, fake, batch_size=4, after_accept=_die_after_first_batch)
    assert len(fake.identifiers()) == 4  # Stripe holds the batch …
    assert _recorded(ledger) == []  # … which the database never marked accepted
    assert len(_recorded(ledger, accepted=False)) == 4

    report = _push(ledger, fake, batch_size=4)
    assert (report.pushed, report.resent, report.repeats) == (10, 4, 4)
    assert _recorded(ledger, accepted=False) == []
    _assert_stripe_matches_ledger(ledger, fake)
    assert len(_recorded(ledger)) == 10
    assert _push(ledger, fake).pushed == 0


def test_a_connection_dropped_after_stripe_stored_the_event_is_retried_as_a_repeat(
    ledger: Ledger, fake: FakeStripe
) -> None:
    acme = ledger.tenant("cus_Acme")
    start = hour_of(ledger.clock.now())
    for hours_ago in (2, 3, 4):
        ledger.usage(acme, "training", start - timedelta(hours=hours_ago), 333)
    fake.drop_next(2)
    report = _push(ledger, fake)
    assert (report.pushed, report.repeats) == (3, 1)
    _assert_stripe_matches_ledger(ledger, fake)


def test_a_429_storm_ends_in_success_without_duplicates(ledger: Ledger, fake: FakeStripe) -> None:
    acme = ledger.tenant("cus_Acme")
    start = hour_of(ledger.clock.now())
    for hours_ago in (2, 3):
        ledger.usage(acme, "sampling_sample", start - timedelta(hours=hours_ago), 10**9 + 1)
    fake.fail_next(4, status=429)
    delays: list[float] = []
    report = push_usage(ledger.database, _gateway(fake, delays), ledger.clock)
    assert report.pushed == 2
    _assert_stripe_matches_ledger(ledger, fake)
    policy = RetryPolicy()
    assert len(delays) == 4
    assert all(0 <= d <= policy.base_delay * 2**n for n, d in enumerate(delays))


def test_stripe_down_past_the_retries_keeps_what_it_accepted_and_the_next_push_finishes(
    ledger: Ledger, fake: FakeStripe
) -> None:
    acme = ledger.tenant("cus_Acme")
    start = hour_of(ledger.clock.now())
    for hours_ago in (2, 3, 4):
        ledger.usage(acme, "training", start - timedelta(hours=hours_ago), 50)
    gateway = StripeGateway(
        stripe_server.API_KEY,
        api_base=fake.url,
        retry=RetryPolicy(attempts=3),
        sleep=lambda _: None,
    )
    real_send = gateway.send_meter_event
    sent: list[str] = []

    def send_then_break(event: object) -> bool:
        created = real_send(event)  # type: ignore[arg-type]
        sent.append("ok")
        if len(sent) == 1:
            fake.fail_next(3, status=503)
        return created

    gateway.send_meter_event = send_then_break  # type: ignore[method-assign]
    with pytest.raises(StripeUnavailable, match="after 3 attempts"):
        push_usage(ledger.database, gateway, ledger.clock)
    assert len(_recorded(ledger)) == 1
    assert len(_recorded(ledger, accepted=False)) == 2
    report = _push(ledger, fake)
    assert (report.pushed, report.resent, report.repeats) == (2, 2, 0)
    _assert_stripe_matches_ledger(ledger, fake)


def test_late_usage_for_a_pushed_hour_goes_as_part_1(ledger: Ledger, fake: FakeStripe) -> None:
    acme = ledger.tenant("cus_Acme")
    hour = hour_of(ledger.clock.now()) - timedelta(hours=2)
    ledger.usage(acme, "training", hour, 4_000)
    assert _push(ledger, fake).pushed == 1
    ledger.usage(acme, "training", hour, 250)  # recorded late, for the same hour and price
    assert _push(ledger, fake).pushed == 1
    assert [(part, value) for _, part, value in _recorded(ledger)] == [(0, 4_000), (1, 250)]
    assert fake.identifiers()[-1].endswith("-1")
    _assert_stripe_matches_ledger(ledger, fake)


def test_usage_recorded_between_a_crash_after_accept_and_the_restart_goes_as_part_1(
    ledger: Ledger, fake: FakeStripe
) -> None:
    acme = ledger.tenant("cus_Acme")
    hour = hour_of(ledger.clock.now()) - timedelta(hours=2)
    ledger.usage(acme, "training", hour, 4_000)
    with pytest.raises(Killed):
        _push(ledger, fake, after_accept=_die_after_first_batch)
    ledger.usage(acme, "training", hour, 250)  # recorded late, before the pusher restarts

    report = _push(ledger, fake)
    assert (report.pushed, report.resent, report.repeats) == (2, 1, 1)
    held = [(e.identifier[-2:], e.value) for e in fake.events]
    assert held == [("-0", 4_000), ("-1", 250)]
    assert [(part, value) for _, part, value in _recorded(ledger)] == [(0, 4_000), (1, 250)]
    _assert_stripe_matches_ledger(ledger, fake)
    assert fake.total("treadle_training", "cus_Acme") == 4_250
    assert _push(ledger, fake).pushed == 0


def test_a_refused_part_is_forgotten_and_one_intended_but_never_sent_keeps_its_value(
    ledger: Ledger, fake: FakeStripe
) -> None:
    acme = ledger.tenant("cus_Acme")
    hour = hour_of(ledger.clock.now()) - timedelta(hours=2)
    ledger.usage(acme, "training", hour, 900)
    fake.fail_next(1, status=400)  # refused for good: the intent is forgotten, not the usage
    assert _push(ledger, fake).refused != []
    assert _recorded(ledger, accepted=False) == []

    # The process dies after recording its intent and before Stripe sees the event.
    gateway = _gateway(fake)

    def die_before_sending(event: object) -> bool:
        raise Killed("process killed before sending")

    gateway.send_meter_event = die_before_sending  # type: ignore[method-assign]
    with pytest.raises(Killed):
        push_usage(ledger.database, gateway, ledger.clock)
    assert [(p, v) for _, p, v in _recorded(ledger, accepted=False)] == [(0, 900)]
    ledger.usage(acme, "training", hour, 11)

    report = _push(ledger, fake)
    assert (report.pushed, report.resent, report.repeats) == (2, 1, 0)
    assert [(e.identifier[-2:], e.value) for e in fake.events] == [("-0", 900), ("-1", 11)]
    _assert_stripe_matches_ledger(ledger, fake)


@pytest.mark.parametrize("held", [True, False])
def test_a_part_unconfirmed_past_stripes_identifier_window_waits_for_the_operator(
    ledger: Ledger, fake: FakeStripe, held: bool
) -> None:
    acme = ledger.tenant("cus_Acme")
    hour = hour_of(ledger.clock.now()) - timedelta(hours=2)
    ledger.usage(acme, "training", hour, 5_000)
    if held:
        with pytest.raises(Killed):
            _push(ledger, fake, after_accept=_die_after_first_batch)
    else:
        fake.fail_next(RetryPolicy().attempts, status=503)
        with pytest.raises(StripeUnavailable):
            _push(ledger, fake)
    assert len(fake.events) == (1 if held else 0)
    ledger.clock.advance(RESEND_WITHIN.total_seconds() + 60)
    ledger.usage(acme, "training", hour, 70)

    # Stripe may have forgotten the identifier: the part is reported, not sent; the late usage
    # still goes, as part 1.
    report = _push(ledger, fake)
    assert [(p.part, p.value) for p in report.unconfirmed] == [(0, 5_000)]
    assert (report.pushed, report.resent) == (1, 0)
    assert len(fake.events) == (2 if held else 1)
    assert [p.part for p in _push(ledger, fake).unconfirmed] == [0]

    identifier = report.unconfirmed[0].identifier
    stripe_parts.resolve(ledger.database, ledger.clock, identifier, held=held)
    with pytest.raises(NotFound, match="awaits acceptance"):
        stripe_parts.resolve(ledger.database, ledger.clock, identifier, held=held)
    again = _push(ledger, fake)
    assert again.unconfirmed == []
    assert again.pushed == (0 if held else 1)
    _assert_stripe_matches_ledger(ledger, fake)
    assert len(fake.identifiers()) == len(set(fake.identifiers()))


def test_zero_value_cells_and_unpriced_usage_are_not_pushed(
    ledger: Ledger, fake: FakeStripe
) -> None:
    acme = ledger.tenant("cus_Acme")
    hour = hour_of(ledger.clock.now()) - timedelta(hours=2)
    ledger.usage(acme, "training", hour, 0)
    ledger.usage(acme, "sampling_sample", hour, 0, price=None)
    assert _push(ledger, fake).pushed == 0
    assert fake.identifiers() == []


def test_hours_past_stripes_age_limit_are_reported_not_pushed(
    ledger: Ledger, fake: FakeStripe
) -> None:
    acme = ledger.tenant("cus_Acme")
    now = hour_of(ledger.clock.now())
    ledger.usage(acme, "training", now - timedelta(days=36), 77)
    ledger.usage(acme, "training", now - timedelta(days=34), 88)
    report = _push(ledger, fake)
    assert report.pushed == 1
    assert [(cell.hour, value) for cell, value in report.too_old] == [
        (now - timedelta(days=36), 77)
    ]
    assert fake.total("treadle_training", "cus_Acme") == 88


def test_the_reconciler_finds_what_stripe_holds_beyond_the_ledger(
    ledger: Ledger, fake: FakeStripe
) -> None:
    acme, globex = ledger.tenant("cus_Acme"), ledger.tenant("cus_Globex")
    start = hour_of(ledger.clock.now())
    since = start - timedelta(days=1)
    for tenant in (acme, globex):
        ledger.usage(tenant, "training", start - timedelta(hours=3), 9_000)
        ledger.usage(tenant, "sampling_sample", start - timedelta(hours=2), 1_500)
    _push(ledger, fake)

    clean = reconcile(ledger.database, _gateway(fake), ledger.clock, since=since)
    assert clean.differences == []
    assert {(b.kind, b.stripe_micros) for b in clean.balances if b.tenant_id == acme} >= {
        ("training", 9_000),
        ("sampling_sample", 1_500),
    }

    fake.add_event("treadle_training", "cus_Globex", 42, start - timedelta(hours=3))
    found = reconcile(ledger.database, _gateway(fake), ledger.clock, since=since)
    assert [
        (b.tenant_id, b.kind, b.stripe_micros - b.ledger_micros) for b in found.differences
    ] == [(globex, "training", 42)]
    # Hours after `until` are left out on both sides.
    before = reconcile(
        ledger.database, _gateway(fake), ledger.clock, since=since, until=start - timedelta(hours=3)
    )
    assert before.differences == [] and all(b.ledger_micros == 0 for b in before.balances)


def test_an_event_stripe_refuses_is_reported_and_the_rest_still_go(
    ledger: Ledger, fake: FakeStripe
) -> None:
    acme = ledger.tenant("cus_Acme")
    hour = hour_of(ledger.clock.now()) - timedelta(hours=2)
    ledger.usage(acme, "checkpoint", hour, 3_000)  # no meter for checkpoints in this Stripe
    ledger.usage(acme, "training", hour, 10)
    report = _push(ledger, fake)
    assert report.pushed == 1
    assert [(ident.split("-")[2], "No active meter" in why) for ident, why in report.refused] == [
        ("checkpoint", True)
    ]
    result = reconcile(
        ledger.database, _gateway(fake), ledger.clock, since=ledger.clock.now() - timedelta(days=1)
    )
    assert [(b.kind, b.meter_found, b.ledger_micros) for b in result.differences] == [
        ("checkpoint", False, 3_000)
    ]


def test_the_periodic_jobs_push_in_the_background_once_a_key_is_set(
    ledger: Ledger, fake: FakeStripe, tmp_path: Path
) -> None:
    acme = ledger.tenant("cus_Acme")
    ledger.usage(acme, "training", hour_of(ledger.clock.now()) - timedelta(hours=2), 64)
    keyless = Settings(data_dir=tmp_path, database_url=ledger.database.url)
    jobs.run_periodic(ledger.database, keyless, ledger.clock)
    assert running_push(ledger.database) is None

    configured = keyless.model_copy(
        update={"stripe_api_key": SecretStr(stripe_server.API_KEY), "stripe_api_base": fake.url}
    )
    jobs.run_periodic(ledger.database, configured, ledger.clock)
    thread = running_push(ledger.database)
    assert thread is not None
    thread.join(timeout=60)
    assert fake.total("treadle_training", "cus_Acme") == 64
