"""The reconciler: what Stripe's meters hold per tenant and usage kind over a period, beside what
the ledger says they should hold.

Only settled hours are compared (the pusher sends nothing sooner), so a period's end is moved
back to the last settled hour. Stripe aggregates meter events asynchronously: an event accepted
a minute ago may not be in its summaries yet, so a difference on recent hours can be a delay.

Each run's result is kept in `stripe_reconciliations` (the differing balances only, so a row
stays small however many tenants were compared), whoever ran it, so the dashboard can show the
latest; a run Stripe did not answer is kept as failed. A run that compared nothing (a period
with no settled hour yet, no tenant linked to Stripe) is kept as `empty`, never as `equal`: it
says nothing of Stripe's balances, so the dashboard keeps showing the latest run that did.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import func, select
from sqlalchemy.orm import Session as OrmSession

from billing.stripe_gateway import StripeGateway, StripeUnavailable
from billing.stripe_push import meter_event_name, settled_before
from billing.tables import USAGE_KINDS, StripeMeterPush, StripeReconciliation, UsageEvent
from core.clock import Clock
from core.db import Database
from core.tables import Tenant

log = logging.getLogger(__name__)

Outcome = Literal["equal", "differs", "failed", "empty"]


@dataclass(frozen=True)
class MeterBalance:
    """One tenant's one usage kind over a period, in micro-units."""

    tenant_id: str
    tenant_name: str
    kind: str
    event_name: str
    stripe_micros: int
    ledger_micros: int
    recorded_micros: int  # what `stripe_meter_pushes` marks as accepted by Stripe
    meter_found: bool

    @property
    def differs(self) -> bool:
        return self.stripe_micros != self.ledger_micros


@dataclass(frozen=True)
class Reconciliation:
    since: datetime
    until: datetime
    balances: list[MeterBalance]

    @property
    def differences(self) -> list[MeterBalance]:
        return [balance for balance in self.balances if balance.differs]

    @property
    def outcome(self) -> Outcome:
        if not self.balances:
            return "empty"
        return "differs" if self.differences else "equal"


def reconcile(
    database: Database,
    gateway: StripeGateway,
    clock: Clock,
    *,
    since: datetime,
    until: datetime | None = None,
    meter_prefix: str = "treadle",
    settle_seconds: float = 600.0,
) -> Reconciliation:
    """Compare Stripe with the ledger for every tenant linked to a Stripe customer, over the
    whole hours in [since, until) that have settled (`until` defaults to now). The result is
    kept (`record`); a run that Stripe did not answer is kept as failed, and raises."""
    since = since.replace(minute=0, second=0, microsecond=0)
    until = min(until or clock.now(), settled_before(clock.now(), settle_seconds))
    until = until.replace(minute=0, second=0, microsecond=0)
    if until <= since:
        return record(database, clock, Reconciliation(since, until, []))
    with database.reader() as db:
        tenants = [
            (tenant_id, name, customer)
            for tenant_id, name, customer in db.execute(
                select(Tenant.id, Tenant.name, Tenant.stripe_customer_id)
                .where(Tenant.stripe_customer_id.is_not(None))
                .order_by(Tenant.name)
            )
            if customer is not None  # not selected; for the type checker
        ]
        ledger = _ledger_sums(db, since, until)
        recorded = _recorded_sums(db, since, until)
    try:
        balances = _balances(gateway, tenants, ledger, recorded, meter_prefix, since, until)
    except StripeUnavailable as exc:
        record(database, clock, Reconciliation(since, until, []), error=exc.message)
        raise
    result = record(database, clock, Reconciliation(since, until, balances))
    for balance in result.differences:
        log.warning(
            "Stripe meter %s holds %d micro-units for tenant %s over %s..%s; the ledger says %d%s",
            balance.event_name,
            balance.stripe_micros,
            balance.tenant_name,
            since.isoformat(),
            until.isoformat(),
            balance.ledger_micros,
            "" if balance.meter_found else " (no active meter with that event name in Stripe)",
        )
    return result


def record(
    database: Database, clock: Clock, result: Reconciliation, *, error: str | None = None
) -> Reconciliation:
    """Keep a run's result (failed when `error` says why Stripe did not answer); returns it."""
    outcome: Outcome = "failed" if error is not None else result.outcome
    differences: list[dict[str, Any]] = [asdict(balance) for balance in result.differences]
    with database.transaction() as db:
        db.add(
            StripeReconciliation(
                ran_at=clock.now(),
                since=result.since,
                until=result.until,
                outcome=outcome,
                compared=len(result.balances),
                differences=differences,
                error=error,
            )
        )
    return result


def _balances(
    gateway: StripeGateway,
    tenants: list[tuple[str, str, str]],
    ledger: dict[tuple[str, str], int],
    recorded: dict[tuple[str, str], int],
    meter_prefix: str,
    since: datetime,
    until: datetime,
) -> list[MeterBalance]:
    """Stripe's sum beside the ledger's for each linked tenant and usage kind."""
    meters = gateway.meter_ids()
    balances: list[MeterBalance] = []
    for tenant_id, name, customer in tenants:
        for kind in USAGE_KINDS:
            event_name = meter_event_name(meter_prefix, kind)
            meter_id = meters.get(event_name)
            owed = ledger.get((tenant_id, kind), 0)
            held = 0 if meter_id is None else gateway.summed_value(meter_id, customer, since, until)
            if meter_id is None and owed == 0:
                continue
            balances.append(
                MeterBalance(
                    tenant_id=tenant_id,
                    tenant_name=name,
                    kind=kind,
                    event_name=event_name,
                    stripe_micros=held,
                    ledger_micros=owed,
                    recorded_micros=recorded.get((tenant_id, kind), 0),
                    meter_found=meter_id is not None,
                )
            )
    return balances


def _ledger_sums(db: OrmSession, since: datetime, until: datetime) -> dict[tuple[str, str], int]:
    rows = db.execute(
        select(UsageEvent.tenant_id, UsageEvent.kind, func.sum(UsageEvent.amount_micros))
        .where(UsageEvent.price_id.is_not(None), UsageEvent.hour >= since, UsageEvent.hour < until)
        .group_by(UsageEvent.tenant_id, UsageEvent.kind)
    )
    return {(tenant_id, kind): int(total or 0) for tenant_id, kind, total in rows}


def _recorded_sums(db: OrmSession, since: datetime, until: datetime) -> dict[tuple[str, str], int]:
    rows = db.execute(
        select(
            StripeMeterPush.tenant_id, StripeMeterPush.kind, func.sum(StripeMeterPush.value_micros)
        )
        .where(
            StripeMeterPush.hour >= since,
            StripeMeterPush.hour < until,
            StripeMeterPush.accepted_at.is_not(None),
        )
        .group_by(StripeMeterPush.tenant_id, StripeMeterPush.kind)
    )
    return {(tenant_id, kind): int(total or 0) for tenant_id, kind, total in rows}
