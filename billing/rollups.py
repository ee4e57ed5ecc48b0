"""Rollups of the usage ledger: events, quantities and cost per tenant, hour, API key,
session, base model, kind and price version (`UsageRollup`), and the same per UTC day without
session and price version (`DailyUsage`, for the admin dashboard's ranges across tenants).

The ledger adds each event it inserts (`add_to_rollups`, in the same transaction, one upsert
per table), so a rollup always equals the sum of its events; `recompute_rollups` rebuilds them
from the ledger should they ever be damaged. Readers sum rollups (`rollup_totals`) instead of
scanning events. Missing dimensions are keyed `NO_DIMENSION` (API key, session) and price 0
(unpriced).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, cast

from sqlalchemy import (
    ColumnElement,
    Executable,
    String,
    Table,
    delete,
    func,
    insert,
    literal_column,
    select,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session as OrmSession

from billing.tables import NO_DIMENSION, DailyUsage, UsageEvent, UsageRollup

Dimension = Literal["hour", "api_key_id", "session_id", "base_model", "kind", "price_id"]
DIMENSIONS: tuple[Dimension, ...] = (
    "hour",
    "api_key_id",
    "session_id",
    "base_model",
    "kind",
    "price_id",
)

# The unique keys of the hourly and daily rollups, and what each row sums.
_HOUR_KEY = ("tenant_id", "hour", "api_key_id", "session_id", "base_model", "kind", "price_id")
_DAY_KEY = ("day", "tenant_id", "api_key_id", "base_model", "kind")
_SUMS = ("events", "quantity", "cached_quantity", "amount_micros")


@dataclass(frozen=True)
class RolledEvent:
    """What a rollup needs of one inserted usage event."""

    tenant_id: str
    hour: datetime
    api_key_id: str | None
    session_id: str | None
    base_model: str
    kind: str
    price_id: int | None
    quantity: int
    cached_quantity: int
    amount_micros: int


@dataclass(frozen=True)
class RollupTotal:
    """Sums over the rollups of one group: `group` holds the grouping dimensions' values as
    stored (`NO_DIMENSION` for no API key or session, price 0 for unpriced)."""

    group: dict[str, str | int | datetime]
    events: int
    quantity: int
    cached_quantity: int
    amount_micros: int


def add_to_rollups(db: OrmSession, events: Iterable[RolledEvent]) -> None:
    """Add newly inserted events to their hourly and daily rollups (one upsert each); call it
    in the transaction that inserted them, and only for events actually inserted."""
    hours: dict[tuple[str, datetime, str, str, str, str, int], list[int]] = {}
    days: dict[tuple[datetime, str, str, str, str], list[int]] = {}
    for e in events:
        api_key_id = e.api_key_id or NO_DIMENSION
        hour = (
            e.tenant_id,
            e.hour,
            api_key_id,
            e.session_id or NO_DIMENSION,
            e.base_model,
            e.kind,
            e.price_id or 0,
        )
        day = (_day(e.hour), e.tenant_id, api_key_id, e.base_model, e.kind)
        for cell in (hours.setdefault(hour, [0, 0, 0, 0]), days.setdefault(day, [0, 0, 0, 0])):
            cell[0] += 1
            cell[1] += e.quantity
            cell[2] += e.cached_quantity
            cell[3] += e.amount_micros
    if not hours:
        return
    dialect = db.get_bind().dialect.name
    # Each table's rows in one order, hours before days, for every writer: no deadlock.
    db.execute(
        _ADD_HOURS[dialect],
        [
            dict(zip(_HOUR_KEY, key, strict=True)) | dict(zip(_SUMS, cell, strict=True))
            for key, cell in sorted(hours.items())
        ],
    )
    db.execute(
        _ADD_DAYS[dialect],
        [
            dict(zip(_DAY_KEY, key, strict=True)) | dict(zip(_SUMS, cell, strict=True))
            for key, cell in sorted(days.items())
        ],
    )


def _day(hour: datetime) -> datetime:
    """The UTC midnight starting the day of an hour."""
    return hour.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)


def _add(
    insert: Callable[[Table], postgresql.Insert | sqlite.Insert], table: Table, key: Sequence[str]
) -> Executable:
    statement = insert(table)
    added, c = statement.excluded, table.c
    return statement.on_conflict_do_update(
        index_elements=[c[name] for name in key],
        set_={name: c[name] + added[name] for name in _SUMS},
    )


# Built once, given their rows at execution, so each is compiled once per process.
_ADD_HOURS = {
    name: _add(insert, cast(Table, UsageRollup.__table__), _HOUR_KEY)
    for name, insert in (("postgresql", postgresql.insert), ("sqlite", sqlite.insert))
}
_ADD_DAYS = {
    name: _add(insert, cast(Table, DailyUsage.__table__), _DAY_KEY)
    for name, insert in (("postgresql", postgresql.insert), ("sqlite", sqlite.insert))
}


def recompute_rollups(
    db: OrmSession,
    *,
    tenant_id: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> int:
    """Rebuild the hourly rollups of hours in [since, until) (of one tenant, or all) from the
    ledger, replacing what was there, then the daily rollups of every day those hours touch
    from the hourly ones; returns how many hourly rollup rows it wrote. For repair: the ledger
    is the truth, and the rollups are its sums."""
    scope = []
    event_scope = []
    if tenant_id is not None:
        scope.append(UsageRollup.tenant_id == tenant_id)
        event_scope.append(UsageEvent.tenant_id == tenant_id)
    if since is not None:
        scope.append(UsageRollup.hour >= since)
        event_scope.append(UsageEvent.hour >= since)
    if until is not None:
        scope.append(UsageRollup.hour < until)
        event_scope.append(UsageEvent.hour < until)
    db.execute(delete(UsageRollup).where(*scope))
    # Inline literals: PostgreSQL matches a grouped expression to the selected one only when
    # they are spelled alike, and two bound parameters are not.
    none = literal_column(f"'{NO_DIMENSION}'", String)
    missing = {"api_key_id": none, "session_id": none, "price_id": literal_column("0")}
    key = [
        func.coalesce(getattr(UsageEvent, name), missing[name])
        if name in missing
        else getattr(UsageEvent, name)
        for name in _HOUR_KEY
    ]
    # A rollup's `events` counts its events; each other sum adds up the event column it names.
    totals = [
        func.count() if name == "events" else func.sum(getattr(UsageEvent, name)) for name in _SUMS
    ]
    sums = select(*key, *totals).where(*event_scope).group_by(*key)
    result = db.execute(insert(UsageRollup).from_select([*_HOUR_KEY, *_SUMS], sums))
    _recompute_days(db, tenant_id, since, until)
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


def _recompute_days(
    db: OrmSession, tenant_id: str | None, since: datetime | None, until: datetime | None
) -> None:
    """Rebuild the daily rollups of the UTC days that [since, until) touches from the hourly
    rollups, which hold every hour of those days (the hours outside the range were kept)."""
    scope = []
    hour_scope = []
    if tenant_id is not None:
        scope.append(DailyUsage.tenant_id == tenant_id)
        hour_scope.append(UsageRollup.tenant_id == tenant_id)
    if since is not None:
        first = _day(since)
        scope.append(DailyUsage.day >= first)
        hour_scope.append(UsageRollup.hour >= first)
    if until is not None:
        end = _day(until - timedelta(microseconds=1)) + timedelta(days=1)
        scope.append(DailyUsage.day < end)
        hour_scope.append(UsageRollup.hour < end)
    db.execute(delete(DailyUsage).where(*scope))
    day = _day_of_hour(db.get_bind().dialect.name)
    columns = (UsageRollup.tenant_id, day, UsageRollup.api_key_id, UsageRollup.base_model)
    sums = (
        select(
            *columns,
            UsageRollup.kind,
            *(func.sum(getattr(UsageRollup, name)) for name in _SUMS),
        )
        .where(*hour_scope)
        .group_by(*columns, UsageRollup.kind)
    )
    db.execute(
        insert(DailyUsage).from_select(
            ["tenant_id", "day", "api_key_id", "base_model", "kind", *_SUMS], sums
        )
    )


def _day_of_hour(dialect: str) -> ColumnElement[Any]:
    """The UTC midnight of a rollup's hour, computed by the database. PostgreSQL truncates in
    UTC (date_trunc on a timestamptz works in the session's time zone), with literal arguments
    since it matches a grouped expression to the selected one only when spelled alike; SQLite
    holds UTC times as text ("YYYY-MM-DD HH:MM:SS.ffffff"), so the date's text is kept."""
    if dialect == "postgresql":
        utc = literal_column("'UTC'", String)
        day = func.date_trunc(literal_column("'day'"), func.timezone(utc, UsageRollup.hour))
        return func.timezone(utc, day)
    return func.substr(UsageRollup.hour, literal_column("1"), literal_column("10")).concat(
        literal_column("' 00:00:00.000000'")
    )


def rollup_totals(
    db: OrmSession,
    tenant_id: str,
    since: datetime | None = None,
    until: datetime | None = None,
    *,
    group_by: Sequence[Dimension] = ("kind",),
    session_id: str | None = None,
    api_key_id: str | None = None,
) -> list[RollupTotal]:
    """The tenant's usage and cost over hours in [since, until), summed per `group_by`
    (ordered by it; no dimensions: one grand total, or none when there was no usage),
    optionally of one session or API key only."""
    for name in group_by:
        if name not in DIMENSIONS:
            raise ValueError(f"cannot group rollups by {name!r}; use some of {DIMENSIONS}")
    columns = [getattr(UsageRollup, name) for name in group_by]
    query = select(
        *columns,
        func.sum(UsageRollup.events),
        func.sum(UsageRollup.quantity),
        func.sum(UsageRollup.cached_quantity),
        func.sum(UsageRollup.amount_micros),
    ).where(UsageRollup.tenant_id == tenant_id)
    if since is not None:
        query = query.where(UsageRollup.hour >= since)
    if until is not None:
        query = query.where(UsageRollup.hour < until)
    if session_id is not None:
        query = query.where(UsageRollup.session_id == session_id)
    if api_key_id is not None:
        query = query.where(UsageRollup.api_key_id == api_key_id)
    if columns:
        query = query.group_by(*columns).order_by(*columns)
    totals = []
    for row in db.execute(query):
        *values, events, quantity, cached, amount = row
        if events is None:
            continue  # no rows: the grand total of nothing
        totals.append(
            RollupTotal(
                group=dict(zip(group_by, values, strict=True)),
                events=int(events),
                quantity=int(quantity),
                cached_quantity=int(cached),
                amount_micros=int(amount),
            )
        )
    return totals
