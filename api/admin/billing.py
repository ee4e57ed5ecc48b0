"""What the dashboard's billing page shows: whether this server bills to Stripe, how far Stripe's
meters lag behind the usage, the parts that await the operator, and the latest reconciliation.

It reads the push record (`stripe_meter_pushes`), the hourly rollups and the reconciler's kept
results, and of the ledger only the storage events' partial index over two days, so the page
costs index lookups however much usage there is:

- parts intended and not accepted come from the partial index on unaccepted parts (few rows);
- when Stripe last accepted a part, and the latest hour it accepted one for, from the indexes
  on `accepted_at` and `hour`;
- the oldest settled hour with usage Stripe has not accepted is the oldest of:
  - the hour of a part not accepted (a push that stopped in a batch, a Stripe that was down);
  - per linked tenant and usage kind, the first settled hour after the latest one Stripe
    accepted for that pair (or within Stripe's age limit, when it accepted none) with priced
    usage: a push sends one tenant and kind at a time in hour order, so hours before the pair's
    latest accepted one went, while one that stopped part way leaves the later pairs behind at
    their own older hours. Taken per pair, not from the latest hour of any tenant, because that
    is exactly what an outage's backlog breaks. One index seek per pair (the push record's
    unique index, then the rollups' (tenant, hour) index walked from that hour), a few hundred
    for a hundred tenants, whatever the ledger holds;
  - the latest hour Stripe accepted for any tenant, where its rollups exceed what Stripe
    accepted for it (usage recorded after its parts went);
  - storage usage metered late for an hour already behind its pair's latest accepted hour
    (`billing.storage` catches up the last `CATCH_UP` hours, and a checkpoint that became
    ready late fills an hour that had no event): per linked tenant, the storage events of that
    window (their partial index, one row per hour) summed beside the storage parts accepted.

Not seen here, and reported by the pusher's log and the reconciler instead: usage of another
kind recorded late into an hour before its pair's latest accepted one (other than the latest
hour Stripe accepted for any tenant); a cell Stripe refused for good, once later hours of its
pair went; cells older than Stripe's age limit; and late storage usage hidden in the window's
sum by an hour of the same tenant that Stripe holds more of than the ledger does. This module
knows the push's rules (`billing.stripe_push`) but sends and writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, and_, case, func, literal, literal_column, or_, select
from sqlalchemy.orm import InstrumentedAttribute
from sqlalchemy.orm import Session as OrmSession

from billing.storage import CATCH_UP, STORAGE, hour_of
from billing.stripe_gateway import MAX_EVENT_AGE_DAYS
from billing.stripe_push import AGE_MARGIN, RESEND_WITHIN, settled_before
from billing.stripe_reconcile import MeterBalance
from billing.tables import (
    USAGE_KINDS,
    StripeMeterPush,
    StripeReconciliation,
    UsageEvent,
    UsageRollup,
)
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
    empty_since_ran_at: datetime | None = None
    """When the latest run that compared nothing ran, where one ran after this one."""


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
            _first_unpushed_hour(db, now, before),
            _late_storage_hour(db, now, before),
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


def _oldest_pushable(now: datetime) -> datetime:
    """Hours before this are past Stripe's age limit: the pusher no longer sends them."""
    return now - timedelta(days=MAX_EVENT_AGE_DAYS) + AGE_MARGIN


def _latest_accepted_hour(kind: str) -> ColumnElement[datetime]:
    """Per linked tenant (correlated with `Tenant`), the latest hour Stripe accepted a part of
    `kind` for: the push record's unique index, read backwards from the pair's last part."""
    return (
        select(StripeMeterPush.hour)
        .where(
            StripeMeterPush.tenant_id == Tenant.id,
            StripeMeterPush.kind == kind,
            StripeMeterPush.accepted_at.is_not(None),
        )
        .order_by(StripeMeterPush.hour.desc())
        .limit(1)
        .correlate(Tenant)
        .scalar_subquery()
    )


def _first_unpushed_hour(db: OrmSession, now: datetime, before: datetime) -> datetime | None:
    """The oldest, over linked tenants and usage kinds, of the first settled hour after the
    latest one Stripe accepted for the pair (or within Stripe's age limit, when it accepted
    none) with priced usage of that pair.

    Per kind, each linked tenant's starting hour is computed once, in a materialized CTE, so
    that the rollups' search from it is a seek on their (tenant, hour) key: bounded by a
    correlated subquery or by two lower bounds, SQLite walked each tenant's whole 35 days."""
    start = oldest_pushable = _oldest_pushable(now) - HOUR
    firsts = []
    for kind in USAGE_KINDS:
        latest = _latest_accepted_hour(kind)
        pairs = (
            select(
                Tenant.id.label("tenant_id"),
                # The later of the pair's latest accepted hour and the age limit (NULL: none).
                case(
                    (latest > oldest_pushable, latest), else_=literal(start, UsageRollup.hour.type)
                ).label("after"),
            )
            .where(Tenant.stripe_customer_id.is_not(None))
            .cte(f"pushed_{kind}")
            .prefix_with("MATERIALIZED")
        )
        first = (
            select(UsageRollup.hour)
            .where(
                UsageRollup.tenant_id == pairs.c.tenant_id,
                UsageRollup.kind == kind,
                UsageRollup.hour > pairs.c.after,
                UsageRollup.hour < before,
                UsageRollup.price_id != 0,
                UsageRollup.amount_micros > 0,
            )
            .order_by(UsageRollup.hour)
            .limit(1)
            .correlate(pairs)
            .scalar_subquery()
        )
        firsts.append(db.scalar(select(func.min(first)).select_from(pairs)))
    return min((hour for hour in firsts if hour is not None), default=None)


def _late_storage_hour(db: OrmSession, now: datetime, before: datetime) -> datetime | None:
    """The oldest hour, up to each linked tenant's latest accepted storage hour and within the
    hours storage metering still catches up, whose storage usage exceeds what Stripe accepted:
    usage metered after later hours were pushed. Summed per tenant first (equal sums, the
    usual case, end the search), then hour by hour for the tenants that differ."""
    since = max(hour_of(now) - CATCH_UP, _oldest_pushable(now))
    latest = _latest_accepted_hour(STORAGE)
    used = select(func.sum(UsageEvent.amount_micros)).where(
        _storage_events(Tenant.id, since, before), UsageEvent.hour <= latest
    )
    taken = select(func.sum(StripeMeterPush.value_micros)).where(
        _storage_parts(Tenant.id, since, before)
    )
    short_tenants = db.scalars(
        select(Tenant.id).where(
            Tenant.stripe_customer_id.is_not(None),
            used.correlate(Tenant).scalar_subquery()
            > func.coalesce(taken.correlate(Tenant).scalar_subquery(), 0),
        )
    ).all()
    return min(
        (
            hour
            for hour in (_short_storage_hour(db, tenant, since, before) for tenant in short_tenants)
            if hour is not None
        ),
        default=None,
    )


def _short_storage_hour(
    db: OrmSession, tenant_id: str, since: datetime, before: datetime
) -> datetime | None:
    """A tenant's oldest hour in [since, before) whose storage usage exceeds what Stripe
    accepted for it."""
    taken: dict[datetime, int] = {
        hour: int(total)
        for hour, total in db.execute(
            select(StripeMeterPush.hour, func.sum(StripeMeterPush.value_micros))
            .where(_storage_parts(tenant_id, since, before))
            .group_by(StripeMeterPush.hour)
        )
    }
    for hour, amount in db.execute(
        select(UsageEvent.hour, UsageEvent.amount_micros)
        .where(_storage_events(tenant_id, since, before))
        .order_by(UsageEvent.hour)
    ):
        if int(amount) > taken.get(hour, 0):
            return hour
    return None


def _storage_events(
    tenant: InstrumentedAttribute[str] | str, since: datetime, before: datetime
) -> ColumnElement[bool]:
    """A tenant's priced storage events of the hours in [since, before); `tenant` is an id, or
    `Tenant.id` in a subquery correlated with the tenants."""
    # The literal kind lets SQLite see that the storage events' partial index applies.
    return and_(
        UsageEvent.tenant_id == tenant,
        UsageEvent.kind == literal_column(f"'{STORAGE}'"),
        UsageEvent.price_id.is_not(None),
        UsageEvent.hour >= since,
        UsageEvent.hour < before,
    )


def _storage_parts(
    tenant: InstrumentedAttribute[str] | str, since: datetime, before: datetime
) -> ColumnElement[bool]:
    """A tenant's storage parts Stripe accepted for the hours in [since, before)."""
    return and_(
        StripeMeterPush.tenant_id == tenant,
        StripeMeterPush.kind == STORAGE,
        StripeMeterPush.accepted_at.is_not(None),
        StripeMeterPush.hour >= since,
        StripeMeterPush.hour < before,
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
    """The latest run that compared something: one that compared nothing (`empty`) says nothing
    of Stripe's balances, so it must not hide an earlier `differs`; it is only noted."""
    latest_first = (StripeReconciliation.ran_at.desc(), StripeReconciliation.id.desc())
    row = db.scalar(
        select(StripeReconciliation)
        .where(StripeReconciliation.outcome != "empty")
        .order_by(*latest_first)
        .limit(1)
    )
    if row is None:
        return None
    empty_at = db.scalar(
        select(StripeReconciliation.ran_at)
        .where(StripeReconciliation.outcome == "empty", StripeReconciliation.ran_at >= row.ran_at)
        .order_by(*latest_first)
        .limit(1)
    )
    return LastReconciliation(
        ran_at=row.ran_at,
        since=row.since,
        until=row.until,
        outcome=row.outcome,
        compared=row.compared,
        differences=[MeterBalance(**balance) for balance in row.differences],
        error=row.error,
        empty_since_ran_at=empty_at,
    )
