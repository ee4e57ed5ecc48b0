"""The dashboard's billing page and `/admin/api/billing`, on SQLite and PostgreSQL, after real
pushes and reconciliations against the fake Stripe on loopback: the oldest settled hour Stripe
lacks (and late usage into an hour already pushed), when Stripe last accepted a part, parts
intended and not accepted, the ones too old to send again awaiting the operator, and the
latest reconciliation as it ended (equal, differing, failed; one that compared nothing is only
noted). Only an admin gets in; a server
without a Stripe key says how to turn billing on."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from billing import stripe_parts
from billing.stripe_gateway import RetryPolicy, StripeGateway, StripeUnavailable
from billing.stripe_parts import Cell, PendingPush, push_identifier
from billing.stripe_push import push_usage
from billing.stripe_reconcile import reconcile
from billing.tables import Price, StripeReconciliation
from core import tenants
from core.clock import FakeClock
from core.db import Database
from tests.builders import TenantKey, record, tenant_factory
from tests.fakes import stripe_server
from tests.fakes.stripe_server import FakeStripe
from tests.server import AppFactory

pytestmark = pytest.mark.integration

NOW = datetime(2026, 3, 10, 12, 30, tzinfo=UTC)  # hours before 12:00 have settled (10 min)
HOUR = timedelta(hours=1)


@dataclass
class Billing:
    client: TestClient
    database: Database
    clock: FakeClock
    fake: FakeStripe
    admin: TenantKey
    acme: TenantKey
    price: int

    def view(self) -> dict[str, Any]:
        response = self.client.get("/admin/api/billing", headers={"X-API-Key": self.admin.key})
        assert response.status_code == 200, response.text
        assert response.headers["cache-control"] == "no-store"
        body: dict[str, Any] = response.json()
        return body

    def use(self, hour: datetime, amount_micros: int, key: TenantKey | None = None) -> None:
        record(self.database, key or self.acme, hour, quantity=1, amount_micros=amount_micros,
               price_id=self.price)  # fmt: skip

    def gateway(self, **kwargs: Any) -> StripeGateway:
        return StripeGateway(stripe_server.API_KEY, api_base=self.fake.url, **kwargs)

    def push(self) -> None:
        assert push_usage(self.database, self.gateway(), self.clock).ran


@pytest.fixture
def billing(app_factory: AppFactory, database_url: str) -> Iterator[Billing]:
    clock = FakeClock(NOW)
    with stripe_server.running(now=clock.now) as fake:
        fake.add_meter("treadle_training")
        app = app_factory(
            database_url,
            clock=clock,
            stripe_api_key=stripe_server.API_KEY,
            stripe_api_base=fake.url,
        )
        state = app.state.treadle
        make = tenant_factory(state.database, state.settings, clock)
        admin, acme = make("operators", scope="admin"), make("acme")
        with state.database.transaction() as db:
            tenants.link_stripe_customer(
                db, clock, tenants.find_tenant(db, acme.tenant_id), "cus_Acme", actor="operator"
            )
            price = db.scalar(select(Price.id).where(Price.kind == "training"))
        assert price is not None
        # Not entered: the app's periodic push stays off, so only the test pushes.
        client = TestClient(app)
        yield Billing(client, state.database, clock, fake, admin, acme, price)


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_the_push_lag_follows_pushes_and_late_usage(billing: Billing) -> None:
    b = billing
    hour = NOW.replace(minute=0)
    globex = tenant_factory(b.database, b.client.app.state.treadle.settings, b.clock)("globex")
    b.use(hour - 7 * HOUR, 999, key=globex)  # not linked to Stripe: never pushed
    b.use(hour - 3 * HOUR, 1_000)
    b.use(hour - HOUR, 2_000)
    b.use(hour, 4_000)  # not settled

    before = b.view()
    assert before["stripe"] == {
        "configured": True,
        "linked_tenants": 1,
        "meter_prefix": "treadle",
        "settle_seconds": 600.0,
        "push_seconds": 300.0,
    }
    lag = before["push"]
    assert _at(lag["oldest_unaccepted_hour"]) == hour - 3 * HOUR
    assert lag["lag_seconds"] == (NOW - (hour - 2 * HOUR)).total_seconds()
    assert (lag["last_accepted_at"], lag["latest_accepted_hour"]) == (None, None)
    assert (lag["unaccepted_parts"], lag["unconfirmed_total"]) == (0, 0)
    assert before["reconciliation"] is None

    b.push()
    lag = b.view()["push"]
    assert (lag["oldest_unaccepted_hour"], lag["lag_seconds"]) == (None, None)
    assert _at(lag["last_accepted_at"]) == NOW
    assert _at(lag["latest_accepted_hour"]) == hour - HOUR

    # Usage recorded late into the last hour pushed: Stripe lacks it until the next push.
    b.clock.advance(60)
    b.use(hour - HOUR, 500)
    assert _at(b.view()["push"]["oldest_unaccepted_hour"]) == hour - HOUR
    b.clock.advance(HOUR.total_seconds())  # and the hour with 4,000 has settled now
    b.push()
    lag = b.view()["push"]
    assert lag["oldest_unaccepted_hour"] is None
    assert _at(lag["latest_accepted_hour"]) == hour
    assert b.fake.total("treadle_training", "cus_Acme") == 1_000 + 2_000 + 500 + 4_000


def _price(b: Billing, kind: str) -> int:
    with b.database.reader() as db:
        price = db.scalar(select(Price.id).where(Price.kind == kind))
    assert price is not None
    return price


def test_a_push_that_stops_part_way_leaves_older_hours_of_later_tenants(billing: Billing) -> None:
    """The push sends one tenant at a time, kind before hour: when Stripe goes away after the
    first tenant's latest hour, the second tenant's older hours were never even intended."""
    b = billing
    hour = NOW.replace(minute=0)
    b.fake.add_meter("treadle_sampling_prefill")
    globex = tenant_factory(b.database, b.client.app.state.treadle.settings, b.clock)("globex")
    with b.database.transaction() as db:
        tenants.link_stripe_customer(
            db, b.clock, tenants.find_tenant(db, globex.tenant_id), "cus_Globex", actor="operator"
        )
    first, second = sorted([b.acme, globex], key=lambda key: key.tenant_id)
    b.use(hour - 3 * HOUR, 1_000, key=first)
    b.use(hour - 2 * HOUR, 2_000, key=first)
    # Sent third (its kind sorts first), and refused by a Stripe gone away; then never sent.
    record(b.database, second, hour - 2 * HOUR, kind="sampling_prefill", quantity=1,
           amount_micros=300, price_id=_price(b, "sampling_prefill"))  # fmt: skip
    b.use(hour - 5 * HOUR, 700, key=second)

    sent: list[int] = []

    def stripe_goes_away_after_two(accepted: list[PendingPush]) -> None:
        sent.append(len(accepted))
        if len(sent) == 2:
            b.fake.fail_next(1, 500)

    with pytest.raises(StripeUnavailable):
        push_usage(b.database, b.gateway(retry=RetryPolicy(attempts=1)), b.clock,
                   batch_size=1, after_accept=stripe_goes_away_after_two)  # fmt: skip
    assert sent == [1, 1, 0]
    lag = b.view()["push"]
    assert _at(lag["latest_accepted_hour"]) == hour - 2 * HOUR
    assert lag["unaccepted_parts"] == 1  # the sampling part, at hour - 2
    assert _at(lag["oldest_unaccepted_hour"]) == hour - 5 * HOUR
    assert lag["lag_seconds"] == (NOW - (hour - 4 * HOUR)).total_seconds()

    b.push()
    assert b.view()["push"]["oldest_unaccepted_hour"] is None
    customer = {b.acme.tenant_id: "cus_Acme", globex.tenant_id: "cus_Globex"}
    assert b.fake.total("treadle_training", customer[second.tenant_id]) == 700
    assert b.fake.total("treadle_sampling_prefill", customer[second.tenant_id]) == 300


def test_storage_metered_late_for_an_hour_before_later_ones_went(billing: Billing) -> None:
    """Storage metering catches up past hours: an hour metered after the next ones were pushed
    is behind every tenant's latest accepted hour, and still missing from Stripe."""
    b = billing
    hour = NOW.replace(minute=0)
    b.fake.add_meter("treadle_storage")
    storage = _price(b, "storage")
    for hours_ago in (4, 2):
        record(b.database, b.acme, hour - hours_ago * HOUR, kind="storage", quantity=1,
               amount_micros=100 * hours_ago, price_id=storage)  # fmt: skip
    b.use(hour - HOUR, 1_000)
    b.push()
    assert b.view()["push"]["oldest_unaccepted_hour"] is None

    b.clock.advance(60)
    record(b.database, b.acme, hour - 3 * HOUR, kind="storage", quantity=1, amount_micros=300,
           price_id=storage)  # fmt: skip
    lag = b.view()["push"]
    assert _at(lag["latest_accepted_hour"]) == hour - HOUR
    assert _at(lag["oldest_unaccepted_hour"]) == hour - 3 * HOUR

    b.push()
    assert b.view()["push"]["oldest_unaccepted_hour"] is None
    assert b.fake.total("treadle_storage", "cus_Acme") == 400 + 300 + 200


def test_parts_not_accepted_and_those_awaiting_the_operator(billing: Billing) -> None:
    b = billing
    hour = NOW.replace(minute=0)
    # Intended by a push that died: one two days ago (not sent again), one a minute ago.
    parts = [
        (NOW - timedelta(days=2), hour - timedelta(days=2), 700),
        (NOW - timedelta(minutes=1), hour - 2 * HOUR, 300),
    ]
    for intended_at, cell_hour, value in parts:
        cell = Cell(b.acme.tenant_id, "training", cell_hour, b.price)
        push = PendingPush(cell, "cus_Acme", 0, value, push_identifier(cell, 0))
        assert stripe_parts.intend(b.database, FakeClock(intended_at), [push]) == [push]

    lag = b.view()["push"]
    assert lag["unaccepted_parts"] == 2
    assert _at(lag["oldest_unaccepted_intended_at"]) == NOW - timedelta(days=2)
    assert _at(lag["oldest_unaccepted_hour"]) == hour - timedelta(days=2)
    assert lag["unconfirmed_total"] == 1
    [waiting] = lag["unconfirmed"]
    assert waiting["identifier"] == push_identifier(
        Cell(b.acme.tenant_id, "training", hour - timedelta(days=2), b.price), 0
    )
    assert (waiting["tenant_name"], waiting["value_micros"]) == ("acme", 700)

    html = b.client.get("/admin/billing", headers={"X-API-Key": b.admin.key}).text
    assert waiting["identifier"] in html and "admin billing resolve" in html

    # A push sends the recent one again; the old one waits until the operator settles it.
    b.push()
    lag = b.view()["push"]
    assert (lag["unaccepted_parts"], lag["unconfirmed_total"]) == (1, 1)
    stripe_parts.resolve(b.database, b.clock, waiting["identifier"], held=True)
    lag = b.view()["push"]
    assert (lag["unaccepted_parts"], lag["unconfirmed_total"], lag["unconfirmed"]) == (0, 0, [])
    assert lag["oldest_unaccepted_hour"] is None


def test_the_latest_reconciliation_is_shown_as_it_ended(billing: Billing) -> None:
    b = billing
    hour = NOW.replace(minute=0)
    b.use(hour - 2 * HOUR, 1_500)
    b.push()
    since = NOW.replace(hour=0, minute=0)

    assert reconcile(b.database, b.gateway(), b.clock, since=since).differences == []
    last = b.view()["reconciliation"]
    assert last["outcome"] == "equal" and last["compared"] == 1 and last["differences"] == []
    assert (_at(last["ran_at"]), _at(last["since"]), _at(last["until"])) == (NOW, since, hour)
    page = b.client.get("/admin/billing", headers={"X-API-Key": b.admin.key}).text
    assert "all equal" in page

    b.clock.advance(60)
    b.fake.add_event("treadle_training", "cus_Acme", 1_000, hour - 2 * HOUR)
    reconcile(b.database, b.gateway(), b.clock, since=since)
    last = b.view()["reconciliation"]
    assert last["outcome"] == "differs" and _at(last["ran_at"]) == NOW + timedelta(seconds=60)
    [differs] = last["differences"]
    assert differs == {
        "tenant_id": b.acme.tenant_id,
        "tenant_name": "acme",
        "kind": "training",
        "event_name": "treadle_training",
        "stripe_micros": 2_500,
        "ledger_micros": 1_500,
        "recorded_micros": 1_500,
        "meter_found": True,
    }
    page = b.client.get("/admin/billing", headers={"X-API-Key": b.admin.key}).text
    assert "1 differ from the ledger" in page and "+1,000" in page

    b.clock.advance(60)
    b.fake.fail_next(1, 500)
    with pytest.raises(StripeUnavailable):
        reconcile(b.database, b.gateway(retry=RetryPolicy(attempts=1)), b.clock, since=since)
    last = b.view()["reconciliation"]
    assert last["outcome"] == "failed" and last["differences"] == [] and last["compared"] == 0
    assert last["error"]  # why Stripe did not answer
    with b.database.reader() as db:
        outcomes = db.scalars(
            select(StripeReconciliation.outcome).order_by(StripeReconciliation.id)
        )
        assert list(outcomes) == ["equal", "differs", "failed"]


def test_a_reconciliation_that_compared_nothing_hides_no_difference(billing: Billing) -> None:
    b = billing
    hour = NOW.replace(minute=0)
    b.use(hour - 2 * HOUR, 1_500)
    b.push()
    b.fake.add_event("treadle_training", "cus_Acme", 1_000, hour - 2 * HOUR)
    since = NOW.replace(hour=0, minute=0)
    assert reconcile(b.database, b.gateway(), b.clock, since=since).outcome == "differs"

    b.clock.advance(60)
    nothing = reconcile(b.database, b.gateway(), b.clock, since=hour)  # no settled hour yet
    assert (nothing.outcome, nothing.balances) == ("empty", [])
    last = b.view()["reconciliation"]
    assert last["outcome"] == "differs" and _at(last["ran_at"]) == NOW
    assert _at(last["empty_since_ran_at"]) == NOW + timedelta(seconds=60)
    page = b.client.get("/admin/billing", headers={"X-API-Key": b.admin.key}).text
    assert "1 differ from the ledger" in page and "all equal" not in page
    assert "compared nothing" in page

    b.clock.advance(60)  # a run that compared something is shown on its own again
    assert reconcile(b.database, b.gateway(), b.clock, since=since).outcome == "differs"
    last = b.view()["reconciliation"]
    assert _at(last["ran_at"]) == NOW + timedelta(seconds=120)
    assert last["empty_since_ran_at"] is None
    with b.database.reader() as db:
        outcomes = db.scalars(
            select(StripeReconciliation.outcome).order_by(StripeReconciliation.id)
        )
        assert list(outcomes) == ["differs", "empty", "differs"]


def test_only_an_admin_reads_billing(billing: Billing) -> None:
    b = billing
    assert b.client.get("/admin/api/billing").status_code == 401
    assert b.client.get("/admin/api/billing", headers={"X-API-Key": b.acme.key}).status_code == 403
    away = b.client.get("/admin/billing", follow_redirects=False)
    assert (away.status_code, away.headers["location"]) == (303, "/admin/login")
    assert b.client.get("/admin/billing", headers={"X-API-Key": b.acme.key}).status_code == 403


def test_a_server_without_a_stripe_key_says_how_to_turn_billing_on(
    app_factory: AppFactory, sqlite_url: str
) -> None:
    app = app_factory(sqlite_url, clock=FakeClock(NOW))
    state = app.state.treadle
    admin = tenant_factory(state.database, state.settings, state.clock)("ops", scope="admin")
    client = TestClient(app)
    headers = {"X-API-Key": admin.key}
    body = client.get("/admin/api/billing", headers=headers).json()
    assert body["stripe"]["configured"] is False and body["push"]["oldest_unaccepted_hour"] is None
    page = client.get("/admin/billing", headers=headers).text
    assert "Billing to Stripe is off" in page
    for setting in ("TREADLE_STRIPE_API_KEY", "TREADLE_STRIPE_METER_PREFIX", "link-stripe"):
        assert setting in page
    assert "No reconciliation has compared anything yet" in page
