"""Usage over time across every tenant, for the dashboard's charts and CSV export.

It sums the hourly rollups (`billing.tables.UsageRollup`), never the ledger, so a request costs
the same however many events an hour held. A rollup row keys tenant, API key, base model and
kind, which are the groupings offered; day buckets are folded from hours by the database, in
UTC. Tokens are the quantities of the token kinds (training, prefill, sampled); checkpoints and
storage add cost but no tokens. Only the largest `TOP_SERIES` groups of the range are charted
one by one; the rest are summed as one "other" series, so a chart stays legible with hundreds
of tenants.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from sqlalchemy import ColumnElement, case, func, literal_column, select
from sqlalchemy.orm import Session as OrmSession

from billing.limits import dollars
from billing.prices import TOKEN_KINDS
from billing.tables import NO_DIMENSION, UsageRollup
from core.errors import InvalidInput
from core.tables import ApiKey, Tenant

Group = Literal["tenant", "key", "model", "kind"]
Bucket = Literal["hour", "day"]
TOP_SERIES = 8
TOP_TENANTS = 10
OTHER = "other"
# Bounds the points a chart draws: a month of hours, or a year of days.
MAX_SPAN = {"hour": timedelta(days=31), "day": timedelta(days=366)}
FIRST_YEAR, LAST_YEAR = 2000, 2200

_COLUMNS = {
    "tenant": UsageRollup.tenant_id,
    "key": UsageRollup.api_key_id,
    "model": UsageRollup.base_model,
    "kind": UsageRollup.kind,
}
_TOKENS = func.sum(case((UsageRollup.kind.in_(TOKEN_KINDS), UsageRollup.quantity), else_=0))
_COST = func.sum(UsageRollup.amount_micros)


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
            f"a {bucket} chart spans at most {MAX_SPAN[bucket].days} days; narrow the range or "
            "use day buckets"
        )


def _floor(moment: datetime, bucket: Bucket) -> datetime:
    hour = moment.replace(minute=0, second=0, microsecond=0)
    return hour.replace(hour=0) if bucket == "day" else hour


def _buckets(start: datetime, end: datetime, bucket: Bucket) -> list[datetime]:
    step = timedelta(days=1) if bucket == "day" else timedelta(hours=1)
    moments, moment = [], _floor(start, bucket)
    while moment < end:
        moments.append(moment)
        moment += step
    return moments


def _bucket_of(db: OrmSession, bucket: Bucket) -> ColumnElement[Any]:
    """The rollup's hour, or its UTC day, folded by the database: a month of days is a few
    thousand rows to read back where its hours would be tens of thousands. Literal arguments,
    since PostgreSQL matches a grouped expression to the selected one only when spelled alike."""
    if bucket == "hour":
        return UsageRollup.hour.expression
    if db.get_bind().dialect.name == "postgresql":
        utc = func.timezone(literal_column("'UTC'"), UsageRollup.hour)
        return func.date_trunc(literal_column("'day'"), utc)
    return func.substr(UsageRollup.hour, 1, 10)  # SQLite holds UTC times as ISO text


def _utc(value: datetime | str) -> datetime:
    """A bucket's start as the database gave it: an aware or naive (UTC) time, or ISO text."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def usage_chart(
    db: OrmSession, start: datetime, end: datetime, bucket: Bucket, group: Group
) -> UsageChart:
    """Tokens and cost of the hours in [start, end) (aware, UTC), per `bucket` and `group`."""
    check_range(start, end, bucket)
    column, bucket_of = _COLUMNS[group], _bucket_of(db, bucket)
    rows = db.execute(
        select(bucket_of, column, _TOKENS, _COST)
        .where(UsageRollup.hour >= start, UsageRollup.hour < end)
        .group_by(bucket_of, column)
    ).all()
    moments = _buckets(start, end, bucket)
    index = {moment: i for i, moment in enumerate(moments)}
    # Rows repeat each bucket once per group: read each bucket's value from the database once.
    position: dict[object, int] = {}
    cells: dict[str, tuple[list[int], list[int]]] = {}
    for moment, key, tokens, cost in rows:
        tokens_by_bucket, cost_by_bucket = cells.setdefault(
            str(key), ([0] * len(moments), [0] * len(moments))
        )
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
        tokens_sum = [sum(cells[k][0][i] for k in folded) for i in range(len(moments))]
        cost_sum = [sum(cells[k][1][i] for k in folded) for i in range(len(moments))]
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
    cost, tokens = _COST.label("cost"), _TOKENS.label("tokens")
    rows = db.execute(
        select(UsageRollup.tenant_id, Tenant.name, tokens, cost)
        .join(Tenant, Tenant.id == UsageRollup.tenant_id)
        .where(UsageRollup.hour >= start, UsageRollup.hour < end)
        .group_by(UsageRollup.tenant_id, Tenant.name)
        .order_by(cost.desc(), tokens.desc(), Tenant.name)
        .limit(TOP_TENANTS)
    ).all()
    return [
        TenantTotal(tid, name, int(t or 0), int(c or 0), dollars(int(c or 0)))
        for tid, name, t, c in rows
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
