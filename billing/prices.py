"""The price book: which price version is in force for a base model and usage kind at a time,
and what a quantity of usage costs under it.

Units (integer micro-units of money): token kinds per million tokens, with a separate rate for
cached prefill tokens; `checkpoint` per checkpoint; `storage` per GB-month, charged per hour
held (a month is 730 hours). Amounts round half up to a whole micro-unit per event.

A version takes effect no sooner than a delay after it was set (`earliest_effective`; a minute
by default, `TREADLE_PRICE_DELAY_SECONDS`), so a process that read the book within
`PriceCache.FRESH` of an event's time already holds every version that can be in force at it:
that is what keeps `PriceCache` exact. Writing versions is `billing.pricebook`'s.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session as OrmSession

from billing.tables import Price
from core.clock import Clock

ANY_MODEL = "*"
TOKEN_KINDS = ("training", "sampling_prefill", "sampling_sample")
HOURS_PER_MONTH = 730
BYTES_PER_GB = 10**9

DEFAULT_PRICE_DELAY = timedelta(seconds=60)
"""The least time between setting a price version and its taking effect, unless configured."""


@dataclass(frozen=True)
class Rate:
    """One price version, detached from the session that read it."""

    id: int
    base_model: str
    kind: str
    unit_micros: int
    cached_unit_micros: int | None
    effective_from: datetime

    @classmethod
    def of(cls, row: Price) -> Rate:
        return cls(
            id=row.id,
            base_model=row.base_model,
            kind=row.kind,
            unit_micros=row.unit_micros,
            cached_unit_micros=row.cached_unit_micros,
            effective_from=row.effective_from,
        )


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
            return Rate.of(row)
    return None


def earliest_effective(now: datetime, delay: timedelta = DEFAULT_PRICE_DELAY) -> datetime:
    """The soonest a version set at `now` may take effect: `delay` later, rounded up to a whole
    minute (to a whole second for a delay under a minute)."""
    soonest = now + delay
    step = timedelta(minutes=1) if delay >= timedelta(minutes=1) else timedelta(seconds=1)
    floor = soonest - (soonest - datetime.min.replace(tzinfo=soonest.tzinfo)) % step
    return floor if floor == soonest else floor + step


class PriceCache:
    """`rate_in_force` from a copy of the whole price book, read again once it is `FRESH` old.

    A copy read at time L answers exactly for any time up to L + FRESH: a version missing from
    it was set after L less the commit's lag, so (see `earliest_effective`) it takes effect after
    L + delay - lag, which is later while the lag (commit time and clock skew between processes)
    stays under the delay less FRESH. Later times read the book again (a table of a few rows,
    so once a second costs nothing measurable). One per process (or per worker host);
    thread-safe.
    """

    FRESH = timedelta(seconds=1)

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._read_at: datetime | None = None
        # (base_model, kind) -> its versions, latest effective first.
        self._versions: dict[tuple[str, str], list[Rate]] = {}

    def __call__(self, db: OrmSession, base_model: str, kind: str, at: datetime) -> Rate | None:
        versions = self._book(db, at)
        for model in (base_model, ANY_MODEL):
            for rate in versions.get((model, kind), ()):
                if rate.effective_from <= at:
                    return rate
        return None

    def _book(self, db: OrmSession, at: datetime) -> dict[tuple[str, str], list[Rate]]:
        with self._lock:
            if self._read_at is not None and at <= self._read_at + self.FRESH:
                return self._versions
        read_at = self._clock.now()  # before the read: a version set meanwhile is newer
        versions: dict[tuple[str, str], list[Rate]] = {}
        for row in db.scalars(select(Price).order_by(Price.effective_from.desc())):
            versions.setdefault((row.base_model, row.kind), []).append(Rate.of(row))
        with self._lock:
            self._read_at, self._versions = read_at, versions
        return versions
