"""Billing tables: the append-only usage ledger, the price book, hourly and daily rollups,
per-period spend counters, the record of what was sent to Stripe and the reconciler's results.

Money is integer micro-units (1e-6 of the currency unit), never floats.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from core.tables import Base

USAGE_KINDS = ("training", "sampling_prefill", "sampling_sample", "checkpoint", "storage")

# Rollups key their optional dimensions with "" instead of NULL, so the unique key matches
# (SQL never treats two NULLs as equal) and an upsert finds the row.
NO_DIMENSION = ""


class UsageEvent(Base):
    """One kind of usage, priced when it is recorded.

    An operation's events are unique per `(operation_id, kind)`, so a redelivered or replayed
    op is never counted twice. Storage events have no operation; they are unique per
    `(tenant_id, hour)`.
    """

    __tablename__ = "usage_events"
    __table_args__ = (
        UniqueConstraint("operation_id", "kind"),
        Index(
            "uq_usage_events_storage_hour",
            "tenant_id",
            "hour",
            unique=True,
            sqlite_where=text("kind = 'storage'"),
            postgresql_where=text("kind = 'storage'"),
        ),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    api_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id"))
    session_id: Mapped[str | None] = mapped_column(ForeignKey("sessions.id"))
    operation_id: Mapped[str | None] = mapped_column(ForeignKey("operations.id"))
    kind: Mapped[str] = mapped_column(String(32))
    base_model: Mapped[str] = mapped_column(String(200))
    quantity: Mapped[int] = mapped_column(BigInteger)
    cached_quantity: Mapped[int] = mapped_column(BigInteger, default=0)
    # The price version in force when the usage happened (NULL: no price, so no charge).
    price_id: Mapped[int | None] = mapped_column(ForeignKey("prices.id"))
    amount_micros: Mapped[int] = mapped_column(BigInteger, default=0)
    # The UTC hour the usage belongs to: the hour it was recorded in, or the metered hour.
    hour: Mapped[datetime]
    created_at: Mapped[datetime]


class Price(Base):
    """One version of the price of one usage kind on one base model, in force from
    `effective_from` until the next version's. Rows are never edited: a change is a new row.

    Units: token kinds per million tokens (`cached_unit_micros` is the rate for cached prefill
    tokens), `checkpoint` per checkpoint, `storage` per GB-month. `base_model` "*" prices every
    model that has no version of its own for that kind.
    """

    __tablename__ = "prices"
    __table_args__ = (UniqueConstraint("base_model", "kind", "effective_from"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    base_model: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(32))
    unit_micros: Mapped[int] = mapped_column(BigInteger)
    cached_unit_micros: Mapped[int | None] = mapped_column(BigInteger)
    effective_from: Mapped[datetime]
    created_at: Mapped[datetime]
    created_by: Mapped[str] = mapped_column(String(64))


class UsageRollup(Base):
    """Usage and cost per tenant, API key, session, base model, kind, price version and hour,
    maintained in the transaction that records each event; recomputable from the ledger."""

    __tablename__ = "usage_rollups"
    __table_args__ = (
        UniqueConstraint(
            "tenant_id", "hour", "api_key_id", "session_id", "base_model", "kind", "price_id"
        ),
        Index("ix_usage_rollups_session_id", "session_id"),
        # The admin dashboard's hour ranges across tenants: its groupings and sums are in the
        # index, so SQLite reads a range without a lookup per row.
        Index(
            "ix_usage_rollups_hour_sums",
            "hour",
            "tenant_id",
            "api_key_id",
            "base_model",
            "kind",
            "quantity",
            "amount_micros",
        ),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    hour: Mapped[datetime]
    api_key_id: Mapped[str] = mapped_column(String(32))  # NO_DIMENSION when none
    session_id: Mapped[str] = mapped_column(String(64))  # NO_DIMENSION when none
    base_model: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(32))
    price_id: Mapped[int] = mapped_column(BigInteger)  # 0 when unpriced
    events: Mapped[int] = mapped_column(BigInteger)
    quantity: Mapped[int] = mapped_column(BigInteger)
    cached_quantity: Mapped[int] = mapped_column(BigInteger)
    amount_micros: Mapped[int] = mapped_column(BigInteger)


class DailyUsage(Base):
    """Usage and cost per tenant, UTC day, API key, base model and kind: the hourly rollups
    summed over sessions and price versions, for readers of many tenants over whole days (the
    admin dashboard), who would otherwise sum a row per hour, session and price. Maintained
    in the same upsert pass as the hourly rollups; recomputable from them."""

    __tablename__ = "usage_daily"
    __table_args__ = (
        # Leading with the day, it is also the index of the dashboard's ranges across tenants.
        UniqueConstraint("day", "tenant_id", "api_key_id", "base_model", "kind"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    day: Mapped[datetime]  # UTC midnight
    api_key_id: Mapped[str] = mapped_column(String(32))  # NO_DIMENSION when none
    base_model: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(32))
    events: Mapped[int] = mapped_column(BigInteger)
    quantity: Mapped[int] = mapped_column(BigInteger)
    cached_quantity: Mapped[int] = mapped_column(BigInteger)
    amount_micros: Mapped[int] = mapped_column(BigInteger)


class TenantSpend(Base):
    """What a tenant has spent in one billing period, kept beside the ledger so the spend
    limit check at submission is one row read."""

    __tablename__ = "tenant_spend"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    period_start: Mapped[datetime] = mapped_column(primary_key=True)
    spent_micros: Mapped[int] = mapped_column(BigInteger)


class StripeMeterPush(Base):
    """A part of a cell's usage meant for Stripe: recorded as intended (`intended_at`, its
    identifier and value fixed) in a committed transaction before it is sent, and marked
    accepted (`accepted_at`) once Stripe accepted it. A part intended but not accepted is sent
    again with the same identifier and value, never recomputed, so Stripe drops a copy it holds
    and usage recorded later goes to a new part.

    One usage kind is one Stripe meter, valued in micro-units of money. A (tenant, kind,
    hour, price) cell is pushed in parts: part 0 when the hour has settled, a later part only
    for usage that arrived after the earlier parts were intended.
    """

    __tablename__ = "stripe_meter_pushes"
    __table_args__ = (
        UniqueConstraint("tenant_id", "kind", "hour", "price_id", "part"),
        # Each push looks for the parts not accepted yet: few rows among all ever pushed.
        Index(
            "ix_stripe_meter_pushes_unaccepted",
            "intended_at",
            sqlite_where=text("accepted_at IS NULL"),
            postgresql_where=text("accepted_at IS NULL"),
        ),
        # The dashboard's billing page: the latest hour Stripe accepted, and when it last did.
        Index("ix_stripe_meter_pushes_hour", "hour"),
        Index("ix_stripe_meter_pushes_accepted_at", "accepted_at"),
    )

    identifier: Mapped[str] = mapped_column(String(200), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    stripe_customer_id: Mapped[str] = mapped_column(String(100))
    kind: Mapped[str] = mapped_column(String(32))
    hour: Mapped[datetime]
    price_id: Mapped[int] = mapped_column(BigInteger)
    part: Mapped[int] = mapped_column(Integer)
    value_micros: Mapped[int] = mapped_column(BigInteger)
    intended_at: Mapped[datetime]
    # NULL until Stripe accepted the part (or answered that it already held its identifier).
    accepted_at: Mapped[datetime | None]


class StripeReconciliation(Base):
    """One run of the reconciler (`billing.stripe_reconcile`): when it ran, the settled hours
    it compared, and how it ended: `equal`, `differs` (`differences` holds each differing
    tenant and meter, as `MeterBalance` fields), `failed` (Stripe did not answer; `error`
    says why) or `empty` (nothing to compare: no settled hour in the period, no tenant linked).
    The dashboard shows the latest run that was not empty; the rows are never edited."""

    __tablename__ = "stripe_reconciliations"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    ran_at: Mapped[datetime] = mapped_column(index=True)
    since: Mapped[datetime]
    until: Mapped[datetime]
    outcome: Mapped[str] = mapped_column(String(16))
    # Tenant and meter pairs compared (a failed run: 0).
    compared: Mapped[int] = mapped_column(Integer)
    differences: Mapped[list[dict[str, Any]]]
    error: Mapped[str | None] = mapped_column(Text)
