"""The price book: which price version is in force for a base model and usage kind at a time,
and what a quantity of usage costs under it.

Units (integer micro-units of money): token kinds per million tokens, with a separate rate for
cached prefill tokens; `checkpoint` per checkpoint; `storage` per GB-month, charged per hour
held (a month is 730 hours). Amounts round half up to a whole micro-unit per event.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session as OrmSession

from billing.tables import Price

ANY_MODEL = "*"
TOKEN_KINDS = ("training", "sampling_prefill", "sampling_sample")
HOURS_PER_MONTH = 730
BYTES_PER_GB = 10**9


@dataclass(frozen=True)
class Rate:
    """One price version, detached from the session that read it."""

    id: int
    base_model: str
    kind: str
    unit_micros: int
    cached_unit_micros: int | None
    effective_from: datetime


def _round_div(numerator: int, denominator: int) -> int:
    return (numerator + denominator // 2) // denominator


def cost_micros(rate: Rate | None, quantity: int, cached_quantity: int = 0) -> int:
    """What `quantity` units of `rate.kind` cost (0 without a price). For `sampling_prefill`,
    `cached_quantity` of the `quantity` tokens are charged at the cached rate; for `storage`,
    `quantity` is bytes held for one hour."""
    if rate is None or quantity <= 0:
        return 0
    if rate.kind in TOKEN_KINDS:
        cached = min(max(cached_quantity, 0), quantity)
        cached_rate = (
            rate.unit_micros if rate.cached_unit_micros is None else rate.cached_unit_micros
        )
        return _round_div((quantity - cached) * rate.unit_micros + cached * cached_rate, 10**6)
    if rate.kind == "storage":
        return _round_div(quantity * rate.unit_micros, BYTES_PER_GB * HOURS_PER_MONTH)
    return quantity * rate.unit_micros  # checkpoint: per unit


def rate_in_force(db: OrmSession, base_model: str, kind: str, at: datetime) -> Rate | None:
    """The version priced for `base_model` and `kind` at `at`: the model's own latest version
    effective by then, else the latest "*" version; None when neither exists."""
    for model in (base_model, ANY_MODEL):
        row = db.execute(
            select(Price)
            .where(Price.base_model == model, Price.kind == kind, Price.effective_from <= at)
            .order_by(Price.effective_from.desc())
            .limit(1)
        ).scalar_one_or_none()
        if row is not None:
            return Rate(
                id=row.id,
                base_model=row.base_model,
                kind=row.kind,
                unit_micros=row.unit_micros,
                cached_unit_micros=row.cached_unit_micros,
                effective_from=row.effective_from,
            )
    return None
