"""Usage over time across every tenant, for the dashboard's charts and CSV export.

It sums rollups, never the ledger, so a request costs the same however many events an hour
held. A range counts the hours that start in it, exactly, whatever its buckets:

- Hour buckets sum the hourly rollups (`billing.tables.UsageRollup`) of the range.
- Day buckets are UTC days. Each whole UTC day of the range is one row per tenant, API key,
  base model and kind in the daily rollups (`billing.tables.DailyUsage`), which fold sessions
  and price versions; a range that starts or ends mid-day reads the hours of that cut day
  (at most 23 at each end) from the hourly rollups, so its first or last bucket holds only
  the day's hours in the range, as it would summed hour by hour.
- The top tenants are the range's totals, read like day buckets whatever the chart's buckets.

Both rollups key tenant, API key, base model and kind, which are the groupings offered. Tokens
are the quantities of the token kinds (training, prefill, sampled); checkpoints and storage add
cost but no tokens. Only the largest `TOP_SERIES` groups of the range are charted one by one;
the rest are summed as one "other" series, so a chart stays legible with hundreds of tenants.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import chain
from typing import Any, Literal, cast

from sqlalchemy import ColumnElement, case, func, select, type_coerce
from sqlalchemy.orm import Session as OrmSession
from sqlalchemy.types import NullType

from billing.limits import dollars
from billing.prices import TOKEN_KINDS
from billing.tables import NO_DIMENSION, DailyUsage, UsageRollup
from core.errors import InvalidInput
from core.tables import ApiKey, Tenant

Group = Literal["tenant", "key", "model", "kind"]
Bucket = Literal["hour", "day"]
TOP_SERIES = 8
TOP_TENANTS = 10
OTHER = "other"
# Bounds the points a chart draws and the rows it sums: an hour chart sums every hourly rollup
# of its range (about 28,000 rows for a week of 100 tenants, four times that for a month, too
# many to answer within 200 ms), so it spans a week; a day chart a year of daily rollups.
MAX_SPAN = {"hour": timedelta(days=7), "day": timedelta(days=366)}
FIRST_YEAR, LAST_YEAR = 2000, 2200

# The column of each grouping, named alike in both rollups.
_COLUMNS = {"tenant": "tenant_id", "key": "api_key_id", "model": "base_model", "kind": "kind"}


@dataclass(frozen=True)
class UsageQuery:
    """What a usage page or route is asked for: the range's bounds as sent (dates or ISO
    times; the default range's where absent), its buckets and how its series are grouped."""

    start: str | None = None
    end: str | None = None
    bucket: Bucket = "day"
    group: Group = "tenant"


@dataclass(frozen=True)
class Series:
    """One group's tokens and cost per bucket, aligned with `UsageChart.buckets`."""

    key: str
    label: str
    tokens: list[int]
    cost_micros: list[int]


@dataclass(frozen=True)
class TenantTotal:
    tenant_id: str
    name: str
    tokens: int
    cost_micros: int
    cost: str
    """The same cost in dollars, as the dashboard shows it."""


@dataclass(frozen=True)
class UsageChart:
    start: datetime
    end: datetime
    bucket: Bucket
    group: Group
    buckets: list[datetime]
    series: list[Series]
    top_tenants: list[TenantTotal]


def check_range(start: datetime, end: datetime, bucket: Bucket) -> None:
    if end <= start:
        raise InvalidInput(f"end {end.isoformat()} is not after start {start.isoformat()}")
    if end - start > MAX_SPAN[bucket]:
        raise InvalidInput(
            f"a {bucket} chart spans at most {MAX_SPAN[bucket].days} days; narrow the range to "
            f"{MAX_SPAN[bucket].days} days or use day buckets"
        )


def _floor(moment: datetime, bucket: Bucket) -> datetime:
    hour = moment.replace(minute=0, second=0, microsecond=0)
    return hour.replace(hour=0) if bucket == "day" else hour


def _ceil(moment: datetime, bucket: Bucket) -> datetime:
    floor = _floor(moment, bucket)
    return floor if floor == moment else floor + _STEP[bucket]


_STEP = {"hour": timedelta(hours=1), "day": timedelta(days=1)}


def _buckets(start: datetime, end: datetime, bucket: Bucket) -> list[datetime]:
    moments, moment = [], _floor(start, bucket)
    while moment < end:
        moments.append(moment)
        moment += _STEP[bucket]
    return moments


@dataclass(frozen=True)
class _Part:
    """A stretch [first, last) of a range, read from one rollup table."""

    table: type[UsageRollup] | type[DailyUsage]
    first: datetime
    last: datetime

    @property
    def moment(self) -> ColumnElement[datetime]:
        """The table's time column: an hourly rollup's hour, or a daily one's day."""
        return (UsageRollup.hour if self.table is UsageRollup else DailyUsage.day).expression

    def within(self) -> tuple[ColumnElement[bool], ColumnElement[bool]]:
        return self.moment >= self.first, self.moment < self.last

    def column(self, name: str) -> ColumnElement[str]:
        return cast(ColumnElement[str], getattr(self.table, name).expression)

    def tokens(self) -> ColumnElement[Any]:
        table = self.table
        return func.sum(case((table.kind.in_(TOKEN_KINDS), table.quantity), else_=0))

    def cost(self) -> ColumnElement[Any]:
        return func.sum(self.table.amount_micros)


def _parts(start: datetime, end: datetime, bucket: Bucket) -> list[_Part]:
    """Where the hours starting in [start, end) are read from: for hour buckets, the hourly
    rollups; for day buckets (and totals), the daily rollups for the range's whole UTC days and
    the hourly ones for the hours of a day the range cuts."""
    if bucket == "hour":
        return [_Part(UsageRollup, start, end)]
    # The hours starting in [start, end) are those in [first hour, last hour).
    first_hour, last_hour = _ceil(start, "hour"), _ceil(end, "hour")
    first_day, last_day = _ceil(first_hour, "day"), _floor(last_hour, "day")
    if first_day >= last_day:
        return [_Part(UsageRollup, first_hour, last_hour)]
    cut = [(first_hour, first_day), (last_day, last_hour)]
    return [_Part(DailyUsage, first_day, last_day)] + [
        _Part(UsageRollup, first, last) for first, last in cut if first < last
    ]


def _utc(value: datetime | str) -> datetime:
    """A time as the database gave it: an aware or naive (UTC) time, or ISO text."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def usage_chart(
    db: OrmSession, start: datetime, end: datetime, bucket: Bucket, group: Group
) -> UsageChart:
    """Tokens and cost of the hours in [start, end) (aware, UTC), per `bucket` and `group`."""
    check_range(start, end, bucket)
    moments = _buckets(start, end, bucket)
    index = {moment: i for i, moment in enumerate(moments)}
    # Rows repeat each time once per group: read each time's value from the database (an aware
    # or naive UTC time, or SQLite's text) and find its bucket once.
    position: dict[object, int] = {}
    cells: dict[str, tuple[list[int], list[int]]] = {}
    for part in _parts(start, end, bucket):
        column = part.column(_COLUMNS[group])
        # A week of hours for 100 tenants is thousands of rows: read through the connection,
        # as plain rows rather than the ORM's, their times as the database holds them, a
        # thousand at a time, so each batch dies young instead of swelling the collector's
        # oldest generation (whose every collection walks the whole process).
        result = db.connection().execute(
            select(type_coerce(part.moment, NullType), column, part.tokens(), part.cost())
            .where(*part.within())
            .group_by(part.moment, column)
        )
        for moment, key, tokens, cost in chain.from_iterable(result.partitions(1000)):
            if key not in cells:
                cells[key] = ([0] * len(moments), [0] * len(moments))
            tokens_by_bucket, cost_by_bucket = cells[key]
            if moment not in position:
                position[moment] = index[_floor(_utc(moment), bucket)]
            i = position[moment]
            tokens_by_bucket[i] += int(tokens or 0)
            cost_by_bucket[i] += int(cost or 0)
    ranked = sorted(cells, key=lambda k: (-sum(cells[k][1]), -sum(cells[k][0]), k))
    shown, folded = ranked[:TOP_SERIES], ranked[TOP_SERIES:]
    labels = _labels(db, group, shown)
    series = [Series(k, labels.get(k, k), *cells[k]) for k in shown]
    if folded:
        # Summed bucket by bucket: zip(*…) lines up the folded groups' values of each bucket.
        tokens_sum = [sum(b) for b in zip(*(cells[k][0] for k in folded), strict=True)]
        cost_sum = [sum(b) for b in zip(*(cells[k][1] for k in folded), strict=True)]
        series.append(Series(OTHER, f"{len(folded)} others", tokens_sum, cost_sum))
    return UsageChart(
        start=start,
        end=end,
        bucket=bucket,
        group=group,
        buckets=moments,
        series=series,
        top_tenants=top_tenants(db, start, end),
    )


def top_tenants(db: OrmSession, start: datetime, end: datetime) -> list[TenantTotal]:
    """The tenants that spent most in [start, end), then used the most tokens."""
    totals: dict[tuple[str, str], list[int]] = {}
    for part in _parts(start, end, "day"):
        tenant_id = part.column("tenant_id")
        rows = db.execute(
            select(tenant_id, Tenant.name, part.tokens(), part.cost())
            .join(Tenant, Tenant.id == tenant_id)
            .where(*part.within())
            .group_by(tenant_id, Tenant.name)
        ).all()
        for tid, name, tokens, cost in rows:
            total = totals.setdefault((tid, name), [0, 0])
            total[0] += int(tokens or 0)
            total[1] += int(cost or 0)
    ranked = sorted(totals.items(), key=lambda item: (-item[1][1], -item[1][0], item[0][1]))
    return [
        TenantTotal(tid, name, tokens, cost, dollars(cost))
        for (tid, name), (tokens, cost) in ranked[:TOP_TENANTS]
    ]


def _labels(db: OrmSession, group: Group, keys: list[str]) -> dict[str, str]:
    """Readable names of tenants and keys (keys: their name and public id)."""
    if group == "tenant" and keys:
        return dict(db.execute(select(Tenant.id, Tenant.name).where(Tenant.id.in_(keys))).all())
    if group == "key":
        names = dict(db.execute(select(ApiKey.id, ApiKey.name).where(ApiKey.id.in_(keys))).all())
        labels = {k: f"{name} ({k})" for k, name in names.items()}
        return labels | ({NO_DIMENSION: "no API key"} if NO_DIMENSION in keys else {})
    return {}


def parse_moment(text: str, name: str) -> datetime:
    """A date (`2026-01-31`: its midnight) or an ISO time, in UTC when it names no zone, in
    the years `FIRST_YEAR` to `LAST_YEAR` (so bucket arithmetic never leaves `datetime`'s)."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidInput(
            f"{name} {text[:40]!r} is neither a date nor an ISO time; send one such as "
            "2026-01-31 or 2026-01-31T12:00:00Z"
        ) from None
    moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    if not FIRST_YEAR <= moment.year <= LAST_YEAR:
        raise InvalidInput(
            f"{name} {text[:40]!r} is outside the years {FIRST_YEAR} to {LAST_YEAR}; "
            "send a date in them"
        )
    return moment


def default_range(now: datetime) -> tuple[datetime, datetime]:
    """The last seven days, today's included."""
    end = _floor(now, "day") + timedelta(days=1)
    return end - timedelta(days=7), end


def parse_range(start: str | None, end: str | None, now: datetime) -> tuple[datetime, datetime]:
    """The range a page or route was asked for: each bound parsed by `parse_moment`, the
    default range's where absent."""
    first, last = default_range(now)
    return (
        first if start is None else parse_moment(start, "start"),
        last if end is None else parse_moment(end, "end"),
    )
