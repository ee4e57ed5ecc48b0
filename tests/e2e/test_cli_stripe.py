"""`treadle-server admin tenants link-stripe` and `admin billing push|reconcile` as an operator
runs them, against a fake Stripe on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from billing import stripe_parts
from billing.stripe_parts import Cell, PendingPush, push_identifier
from billing.tables import StripeReconciliation
from core import tenants
from core.clock import FakeClock
from core.tables import AuditLog
from tests.fakes import stripe_server
from tests.fakes.stripe_server import FakeStripe
from tests.integration.stripe_helpers import Ledger, hour_of

pytestmark = pytest.mark.e2e

CLI = str(Path(sys.executable).with_name("treadle-server"))


@pytest.fixture
def fake() -> Iterator[FakeStripe]:
    with stripe_server.running() as fake:
        fake.add_meter("treadle_training")
        fake.add_meter("treadle_sampling_sample")
        yield fake


def _run(tmp_path: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TREADLE_")}
    env.update(TREADLE_DATA_DIR=str(tmp_path / "data"), COLUMNS="200", **extra)
    return subprocess.run(
        [CLI, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_link_push_and_reconcile(tmp_path: Path, fake: FakeStripe) -> None:
    stripe = {"TREADLE_STRIPE_API_KEY": stripe_server.API_KEY, "TREADLE_STRIPE_API_BASE": fake.url}
    assert _run(tmp_path, "migrate").returncode == 0
    assert _run(tmp_path, "admin", "tenants", "create", "acme").returncode == 0

    refused = _run(tmp_path, "admin", "tenants", "link-stripe", "acme", "acme@example.com")
    assert refused.returncode == 2
    assert "not a Stripe customer id" in refused.stderr
    linked = _run(tmp_path, "admin", "tenants", "link-stripe", "acme", "cus_Acme")
    assert linked.returncode == 0, linked.stderr
    assert "cus_Acme" in linked.stdout

    ledger = Ledger(f"sqlite:///{tmp_path / 'data' / 'treadle.db'}")
    with ledger.database.reader() as db:
        acme = tenants.find_tenant(db, "acme")
        assert acme.stripe_customer_id == "cus_Acme"
        audit = db.scalars(select(AuditLog).where(AuditLog.tenant_id == acme.id)).all()
        assert [(a.action, a.actor, a.target) for a in audit] == [
            ("tenant.stripe_linked", "operator", "cus_Acme")
        ]
    # Settled hours, whatever the wall clock says now.
    hour = hour_of(datetime.now(UTC)) - timedelta(hours=2)
    ledger.usage(acme.id, "training", hour, 2_500_000)
    ledger.usage(acme.id, "sampling_sample", hour - timedelta(hours=1), 125)

    no_key = _run(tmp_path, "admin", "billing", "push")
    assert no_key.returncode == 2
    assert "TREADLE_STRIPE_API_KEY" in no_key.stderr
    pushed = _run(tmp_path, "admin", "billing", "push", **stripe)
    assert pushed.returncode == 0, pushed.stderr
    assert "pushed 2 meter events" in pushed.stdout
    assert fake.total("treadle_training", "cus_Acme") == 2_500_000
    assert "pushed 0 meter events" in _run(tmp_path, "admin", "billing", "push", **stripe).stdout

    since = (hour - timedelta(days=1)).date().isoformat()
    matching = _run(tmp_path, "admin", "billing", "reconcile", "--since", since, **stripe)
    assert matching.returncode == 0, matching.stdout + matching.stderr
    assert "Stripe matches the ledger" in matching.stdout

    fake.add_event("treadle_training", "cus_Acme", 1_000, hour)
    differing = _run(tmp_path, "admin", "billing", "reconcile", "--since", since, **stripe)
    assert differing.returncode == 1
    assert "differs" in differing.stdout
    assert "+1,000" in differing.stdout
    # A period with no settled hour yet compares nothing, and says so rather than "matches".
    unsettled = (datetime.now(UTC) + timedelta(hours=2)).isoformat()
    nothing = _run(tmp_path, "admin", "billing", "reconcile", "--since", unsettled, **stripe)
    assert nothing.returncode == 0, nothing.stdout + nothing.stderr
    assert "Nothing to compare" in nothing.stdout and "matches" not in nothing.stdout
    # Each run's result is kept for the dashboard's billing page.
    with ledger.database.reader() as db:
        kept = db.scalars(select(StripeReconciliation.outcome).order_by(StripeReconciliation.id))
        assert list(kept) == ["equal", "differs", "empty"]


def test_an_unconfirmed_meter_event_is_reported_and_resolved(
    tmp_path: Path, fake: FakeStripe
) -> None:
    stripe = {"TREADLE_STRIPE_API_KEY": stripe_server.API_KEY, "TREADLE_STRIPE_API_BASE": fake.url}
    assert _run(tmp_path, "migrate").returncode == 0
    assert _run(tmp_path, "admin", "tenants", "create", "acme").returncode == 0
    assert _run(tmp_path, "admin", "tenants", "link-stripe", "acme", "cus_Acme").returncode == 0
    ledger = Ledger(f"sqlite:///{tmp_path / 'data' / 'treadle.db'}")
    with ledger.database.reader() as db:
        acme = tenants.find_tenant(db, "acme").id
    hour = hour_of(datetime.now(UTC)) - timedelta(hours=2)
    ledger.usage(acme, "training", hour, 300)
    # A push that died a day ago, after recording its intent: Stripe may have forgotten it.
    cell = Cell(acme, "training", hour, ledger.price)
    part = PendingPush(cell, "cus_Acme", 0, 300, push_identifier(cell, 0))
    stripe_parts.intend(ledger.database, FakeClock(datetime.now(UTC) - timedelta(days=1)), [part])

    pushed = _run(tmp_path, "admin", "billing", "push", **stripe)
    assert pushed.returncode == 0, pushed.stderr
    assert "pushed 0 meter events" in pushed.stdout
    assert f"billing resolve {part.identifier} --held" in " ".join(pushed.stderr.split())
    since = (hour - timedelta(days=1)).date().isoformat()
    short = _run(tmp_path, "admin", "billing", "reconcile", "--since", since, **stripe)
    assert short.returncode == 1 and "-300" in short.stdout

    unknown = _run(tmp_path, "admin", "billing", "resolve", "treadle-nothing", "--held")
    assert unknown.returncode == 2
    assert "awaits acceptance" in unknown.stderr
    resolved = _run(tmp_path, "admin", "billing", "resolve", part.identifier, "--not-held")
    assert resolved.returncode == 0, resolved.stderr
    assert "the next push sends its value" in resolved.stdout
    assert "pushed 1 meter events" in _run(tmp_path, "admin", "billing", "push", **stripe).stdout
    assert fake.total("treadle_training", "cus_Acme") == 300
    matching = _run(tmp_path, "admin", "billing", "reconcile", "--since", since, **stripe)
    assert matching.returncode == 0, matching.stdout + matching.stderr
