"""Writing and listing the price book: versions are only ever added, never edited.

A new version takes effect no sooner than a delay after it is set (a minute by default)
(`billing.prices.earliest_effective`), so every process — each holding a `PriceCache` — has
read it before the first usage it prices happens. An effective time before that is refused.
Reading the version in force for a usage event is `billing.prices`'.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session as OrmSession

from billing.prices import (
    ANY_MODEL,
    DEFAULT_PRICE_DELAY,
    TOKEN_KINDS,
    Rate,
    earliest_effective,
)
from billing.tables import USAGE_KINDS, Price
from core.clock import Clock
from core.errors import InvalidInput


def set_price(
    db: OrmSession,
    clock: Clock,
    *,
    base_model: str,
    kind: str,
    unit_micros: int,
    cached_unit_micros: int | None = None,
    effective_from: datetime | None = None,
    created_by: str = "operator",
    delay: timedelta = DEFAULT_PRICE_DELAY,
) -> Rate:
    """Add a version of the price of `kind` on `base_model` ("*": every model without its own),
    in force from `effective_from` (default: as soon as allowed) until a later version's."""
    if kind not in USAGE_KINDS:
        raise InvalidInput(f"unknown usage kind {kind!r}; use one of {', '.join(USAGE_KINDS)}")
    if not base_model:
        raise InvalidInput(f"base model is empty; name a model, or {ANY_MODEL!r} for every model")
    if unit_micros < 0 or (cached_unit_micros is not None and cached_unit_micros < 0):
        raise InvalidInput("a price cannot be negative; pass 0 or more")
    if cached_unit_micros is not None and kind != "sampling_prefill":
        raise InvalidInput(
            f"only sampling_prefill has a cached rate; drop the cached price for {kind}"
        )
    now = clock.now()
    soonest = earliest_effective(now, delay)
    if effective_from is None:
        effective_from = soonest
    if effective_from.tzinfo is None:
        raise InvalidInput("the effective time has no time zone; give it in UTC, e.g. ...Z")
    if effective_from < soonest:
        raise InvalidInput(
            f"effective time {effective_from.isoformat()} is too soon: a price version takes "
            f"effect no sooner than {delay.total_seconds():g} s after it is set, so that every "
            "server process has read it before it applies (and "
            "usage already recorded is never repriced); pass an effective time at or after "
            f"{soonest.isoformat()}, or none for that time"
        )
    taken = db.scalar(
        select(Price.id).where(
            Price.base_model == base_model,
            Price.kind == kind,
            Price.effective_from == effective_from,
        )
    )
    if taken is not None:
        raise InvalidInput(
            f"{base_model} {kind} already has a version effective at {effective_from.isoformat()} "
            "(versions are never edited); pass a later effective time"
        )
    row = Price(
        base_model=base_model,
        kind=kind,
        unit_micros=unit_micros,
        cached_unit_micros=cached_unit_micros,
        effective_from=effective_from,
        created_at=now,
        created_by=created_by,
    )
    db.add(row)
    db.flush()
    return Rate.of(row)


def prices_in_force(db: OrmSession, at: datetime) -> list[Rate]:
    """Per (base model, kind) written in the book, the version in force at `at`, ordered by
    model then kind; a model's kind without its own version is priced by the "*" one."""
    latest: dict[tuple[str, str], Rate] = {}
    for rate in price_history(db):
        if rate.effective_from <= at:
            latest.setdefault((rate.base_model, rate.kind), rate)
    return sorted(latest.values(), key=_order)


def price_history(
    db: OrmSession, *, base_model: str | None = None, kind: str | None = None
) -> list[Rate]:
    """Every version, latest effective first (future ones included)."""
    query = select(Price).order_by(
        Price.effective_from.desc(), Price.base_model, Price.kind, Price.id
    )
    if base_model is not None:
        query = query.where(Price.base_model == base_model)
    if kind is not None:
        query = query.where(Price.kind == kind)
    return [Rate.of(row) for row in db.scalars(query)]


def unit_of(kind: str) -> str:
    """What one `unit_micros` of `kind` buys, for people reading the book."""
    if kind in TOKEN_KINDS:
        return "per 1M tokens"
    if kind == "storage":
        return "per GB-month"
    return "per checkpoint"


def _order(rate: Rate) -> tuple[bool, str, int]:
    return (rate.base_model != ANY_MODEL, rate.base_model, USAGE_KINDS.index(rate.kind))
