"""Billing tables: the append-only usage ledger, hourly rollups and the price book.

Only the ledger (`usage_events`) is used; rollups and prices are not built yet, so nothing
reads or writes their tables.

Money is integer micro-units (1e-6 of the currency unit), never floats.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Boolean, ForeignKey, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from core.tables import Base

USAGE_KINDS = ("training", "sampling_prefill", "sampling_sample", "checkpoint", "storage")


class UsageEvent(Base):
    """One kind of usage caused by one operation; the unique key makes re-recording a no-op."""

    __tablename__ = "usage_events"
    __table_args__ = (UniqueConstraint("operation_id", "kind"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    session_id: Mapped[str | None] = mapped_column(ForeignKey("sessions.id"))
    operation_id: Mapped[str] = mapped_column(ForeignKey("operations.id"))
    kind: Mapped[str] = mapped_column(String(32))
    base_model: Mapped[str] = mapped_column(String(200))
    quantity: Mapped[int] = mapped_column(BigInteger)
    cached_quantity: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime]


class UsageRollup(Base):
    __tablename__ = "usage_rollups"
    __table_args__ = (UniqueConstraint("tenant_id", "hour", "base_model", "kind"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    hour: Mapped[datetime]
    base_model: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(32))
    quantity: Mapped[int] = mapped_column(BigInteger)
    amount_micros: Mapped[int] = mapped_column(BigInteger)
    reported_to_stripe: Mapped[bool] = mapped_column(Boolean, default=False)


class Price(Base):
    """Price per million units of one usage kind on one base model, from a point in time on."""

    __tablename__ = "prices"
    __table_args__ = (UniqueConstraint("base_model", "kind", "effective_from"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    base_model: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(32))
    micros_per_million: Mapped[int] = mapped_column(BigInteger)
    effective_from: Mapped[datetime]
    created_at: Mapped[datetime]
