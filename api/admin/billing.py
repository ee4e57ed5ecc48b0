"""What the dashboard's billing page shows: whether this server bills to Stripe, how far Stripe's
meters lag behind the usage, the parts that await the operator, and the latest reconciliation.

It reads the push record (`stripe_meter_pushes`), the hourly rollups and the reconciler's kept
results, never the ledger, so the page costs a few index lookups however much usage there is:

- parts intended and not accepted come from the partial index on unaccepted parts (few rows);
- when Stripe last accepted a part, and the latest hour it accepted one for, from the indexes
  on `accepted_at` and `hour`;
- the oldest settled hour with usage Stripe has not accepted is the oldest of: the hour of a
  part not accepted; the latest accepted hour, where its rollups exceed what Stripe accepted
  for it (usage recorded after its parts went); and the first later settled hour with priced
  usage of a tenant linked to Stripe (the rollups' hour index, walked from that hour).

A cell of an earlier hour that never became a part (Stripe refused it for good, its tenant was
linked later, it passed Stripe's age limit) is not seen here: the pusher's log and the
reconciler report it. This module knows the push's rules (`billing.stripe_push`) but sends and
writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, and_, func, or_, select
from sqlalchemy.orm import Session as OrmSession

from billing.stripe_gateway import MAX_EVENT_AGE_DAYS
from billing.stripe_push import AGE_MARGIN, RESEND_WITHIN, settled_before
from billing.stripe_reconcile import MeterBalance
from billing.tables import StripeMeterPush, StripeReconciliation, UsageRollup
from core.settings import Settings
from core.tables import Tenant

UNCONFIRMED_SHOWN = 50
HOUR = timedelta(hours=1)


@dataclass(frozen=True)
class StripeSetup:
    """Billing to Stripe as this server's settings have it (pushes run where the key is set:
    the server in embedded mode, beat in distributed mode)."""

    configured: bool
    """`TREADLE_STRIPE_API_KEY` is set here."""
    linked_tenants: int
    meter_prefix: str
    settle_seconds: float
    push_seconds: float


@dataclass(frozen=True)
class UnconfirmedPart:
    """A part intended so long ago (or for an hour now so old) that it is not sent again."""

    identifier: str
    tenant_id: str
    tenant_name: str
    kind: str
    hour: datetime
    value_micros: int
    intended_at: datetime


@dataclass(frozen=True)
class PushLag:
    oldest_unaccepted_hour: datetime | None
    """The oldest settled hour with usage Stripe has not accepted (None: Stripe is up to date)."""
    lag_seconds: float | None
    """How long ago that hour ended."""
    last_accepted_at: datetime | None
    latest_accepted_hour: datetime | None
    unaccepted_parts: int
    """Parts intended and not marked accepted: a push sends them again, or they await the
    operator (`unconfirmed`)."""
    oldest_unaccepted_intended_at: datetime | None
    unconfirmed_total: int
    unconfirmed: list[UnconfirmedPart]
    """The oldest `UNCONFIRMED_SHOWN` awaiting `treadle-server admin billing resolve`."""


@dataclass(frozen=True)
class LastReconciliation:
    ran_at: datetime
    since: datetime
    until: datetime
    outcome: str
    """`equal`, `differs` or `failed`."""
    compared: int
    differences: list[MeterBalance]
    error: str | None


@dataclass(frozen=True)
class Billing:
    now: datetime
    stripe: StripeSetup
    push: PushLag
    reconciliation: LastReconciliation | None


def billing_view(db: OrmSession, now: datetime, settings: Settings) -> Billing:
    return Billing(
        now=now,
        stripe=_setup(db, settings),
        push=push_lag(db, now, settings.stripe_settle_seconds),
        reconciliation=last_reconciliation(db),
    )


def _setup(db: OrmSession, settings: Settings) -> StripeSetup:
    linked = db.scalar(
        select(func.count()).select_from(Tenant).where(Tenant.stripe_customer_id.is_not(None))
    )
    return StripeSetup(
        configured=settings.stripe_api_key is not None,
        linked_tenants=linked or 0,
        meter_prefix=settings.stripe_meter_prefix,
        settle_seconds=settings.stripe_settle_seconds,
        push_seconds=settings.stripe_push_seconds,
    )


def push_lag(db: OrmSession, now: datetime, settle_seconds: float) -> PushLag:
    unaccepted = StripeMeterPush.accepted_at.is_(None)
    count, oldest_intended, oldest_part_hour = db.execute(
        select(
            func.count(), func.min(StripeMeterPush.intended_at), func.min(StripeMeterPush.hour)
        ).where(unaccepted)
    ).one()
    accepted = StripeMeterPush.accepted_at.is_not(None)
    last_accepted_at = db.scalar(select(func.max(StripeMeterPush.accepted_at)))
    latest_hour = db.scalar(select(func.max(StripeMeterPush.hour)).where(accepted))
    before = settled_before(now, settle_seconds)
    candidates = [
        hour
        for hour in (
            oldest_part_hour,
            _short_hour(db, latest_hour),
            _first_unpushed_hour(db, now, latest_hour, before),
        )
        if hour is not None and hour < before
    ]
    oldest = min(candidates, default=None)
    unconfirmed_total, unconfirmed = _unconfirmed(db, now)
    return PushLag(
        oldest_unaccepted_hour=oldest,
        lag_seconds=None if oldest is None else (now - (oldest + HOUR)).total_seconds(),
        last_accepted_at=last_accepted_at,
        latest_accepted_hour=latest_hour,
        unaccepted_parts=count,
        oldest_unaccepted_intended_at=oldest_intended,
        unconfirmed_total=unconfirmed_total,
        unconfirmed=unconfirmed,
    )


def _priced_usage_of_linked_tenants() -> ColumnElement[bool]:
    return and_(
        UsageRollup.price_id != 0,
        UsageRollup.amount_micros > 0,
        Tenant.stripe_customer_id.is_not(None),
    )


def _short_hour(db: OrmSession, hour: datetime | None) -> datetime | None:
    """`hour` when a cell of it holds more priced usage than Stripe accepted for it."""
    if hour is None:
        return None
    used = db.execute(
        select(
            UsageRollup.tenant_id,
            UsageRollup.kind,
            UsageRollup.price_id,
            func.sum(UsageRollup.amount_micros),
        )
        .join(Tenant, Tenant.id == UsageRollup.tenant_id)
        .where(UsageRollup.hour == hour, _priced_usage_of_linked_tenants())
        .group_by(UsageRollup.tenant_id, UsageRollup.kind, UsageRollup.price_id)
    )
    taken = {
        (tenant, kind, price): int(total)
        for tenant, kind, price, total in db.execute(
            select(
                StripeMeterPush.tenant_id,
                StripeMeterPush.kind,
                StripeMeterPush.price_id,
                func.sum(StripeMeterPush.value_micros),
            )
            .where(StripeMeterPush.hour == hour, StripeMeterPush.accepted_at.is_not(None))
            .group_by(StripeMeterPush.tenant_id, StripeMeterPush.kind, StripeMeterPush.price_id)
        )
    }
    short = any(
        int(total) > taken.get((tenant, kind, price), 0) for tenant, kind, price, total in used
    )
    return hour if short else None


def _first_unpushed_hour(
    db: OrmSession, now: datetime, latest_hour: datetime | None, before: datetime
) -> datetime | None:
    """The first settled hour after the latest one Stripe accepted (or within Stripe's age
    limit, when it never accepted one) with priced usage of a tenant linked to Stripe."""
    start = (
        latest_hour + HOUR
        if latest_hour is not None
        else now - timedelta(days=MAX_EVENT_AGE_DAYS) + AGE_MARGIN
    )
    return db.scalar(
        select(UsageRollup.hour)
        .join(Tenant, Tenant.id == UsageRollup.tenant_id)
        .where(UsageRollup.hour >= start, UsageRollup.hour < before)
        .where(_priced_usage_of_linked_tenants())
        .order_by(UsageRollup.hour)
        .limit(1)
    )


def _unconfirmed(db: OrmSession, now: datetime) -> tuple[int, list[UnconfirmedPart]]:
    """The parts not accepted that a push no longer sends (`billing.stripe_push`'s rule): how
    many, and the oldest of them."""
    awaiting = and_(
        StripeMeterPush.accepted_at.is_(None),
        or_(
            StripeMeterPush.intended_at < now - RESEND_WITHIN,
            StripeMeterPush.hour < now - timedelta(days=MAX_EVENT_AGE_DAYS) + AGE_MARGIN,
        ),
    )
    total = db.scalar(select(func.count()).select_from(StripeMeterPush).where(awaiting)) or 0
    rows = db.execute(
        select(StripeMeterPush, Tenant.name)
        .join(Tenant, Tenant.id == StripeMeterPush.tenant_id)
        .where(awaiting)
        .order_by(StripeMeterPush.intended_at, StripeMeterPush.identifier)
        .limit(UNCONFIRMED_SHOWN)
    )
    return total, [
        UnconfirmedPart(
            identifier=part.identifier,
            tenant_id=part.tenant_id,
            tenant_name=name,
            kind=part.kind,
            hour=part.hour,
            value_micros=part.value_micros,
            intended_at=part.intended_at,
        )
        for part, name in rows
    ]


def last_reconciliation(db: OrmSession) -> LastReconciliation | None:
    row = db.scalar(
        select(StripeReconciliation)
        .order_by(StripeReconciliation.ran_at.desc(), StripeReconciliation.id.desc())
        .limit(1)
    )
    if row is None:
        return None
    return LastReconciliation(
        ran_at=row.ran_at,
        since=row.since,
        until=row.until,
        outcome=row.outcome,
        compared=row.compared,
        differences=[MeterBalance(**balance) for balance in row.differences],
        error=row.error,
    )
