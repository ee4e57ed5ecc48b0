"""Hourly rollups of the usage ledger: events, quantities and cost per tenant, hour, API key,
session, base model, kind and price version.

The ledger adds each event it inserts (`add_to_rollups`, in the same transaction), so a rollup
always equals the sum of its events; `recompute_rollups` rebuilds them from the ledger should
they ever be damaged. Readers sum rollups (`rollup_totals`) instead of scanning events.
Missing dimensions are keyed `NO_DIMENSION` (API key, session) and price 0 (unpriced).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal, cast

from sqlalchemy import Executable, String, Table, delete, func, insert, literal_column, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session as OrmSession

from billing.tables import NO_DIMENSION, UsageEvent, UsageRollup

Dimension = Literal["hour", "api_key_id", "session_id", "base_model", "kind", "price_id"]
DIMENSIONS: tuple[Dimension, ...] = (
    "hour",
    "api_key_id",
    "session_id",
    "base_model",
    "kind",
    "price_id",
)


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
    """Add newly inserted events to their rollups (one upsert); call it in the transaction that
    inserted them, and only for events actually inserted."""
    cells: dict[tuple[str, datetime, str, str, str, str, int], list[int]] = {}
    for e in events:
        key = (
            e.tenant_id,
            e.hour,
            e.api_key_id or NO_DIMENSION,
            e.session_id or NO_DIMENSION,
            e.base_model,
            e.kind,
            e.price_id or 0,
        )
        sums = cells.setdefault(key, [0, 0, 0, 0])
        sums[0] += 1
        sums[1] += e.quantity
        sums[2] += e.cached_quantity
        sums[3] += e.amount_micros
    if not cells:
        return
    db.execute(
        _ADD[db.get_bind().dialect.name],
        [
            {
                "tenant_id": tenant_id,
                "hour": hour,
                "api_key_id": api_key_id,
                "session_id": session_id,
                "base_model": base_model,
                "kind": kind,
                "price_id": price_id,
                "events": events_,
                "quantity": quantity,
                "cached_quantity": cached,
                "amount_micros": amount,
            }
            for (tenant_id, hour, api_key_id, session_id, base_model, kind, price_id), (
                events_,
                quantity,
                cached,
                amount,
            ) in sorted(cells.items())  # one order of row locks for every writer: no deadlock
        ],
    )


def _add(insert: Callable[[Table], postgresql.Insert | sqlite.Insert]) -> Executable:
    rollups = cast(Table, UsageRollup.__table__)
    statement = insert(rollups)
    added, c = statement.excluded, rollups.c
    return statement.on_conflict_do_update(
        index_elements=[
            c.tenant_id,
            c.hour,
            c.api_key_id,
            c.session_id,
            c.base_model,
            c.kind,
            c.price_id,
        ],
        set_={
            "events": c.events + added.events,
            "quantity": c.quantity + added.quantity,
            "cached_quantity": c.cached_quantity + added.cached_quantity,
            "amount_micros": c.amount_micros + added.amount_micros,
        },
    )


# Built once, given its rows at execution, so it is compiled once per process.
_ADD = {"postgresql": _add(postgresql.insert), "sqlite": _add(sqlite.insert)}


def recompute_rollups(
    db: OrmSession,
    *,
    tenant_id: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> int:
    """Rebuild the rollups of hours in [since, until) (of one tenant, or all) from the ledger,
    replacing what was there; returns how many rollup rows it wrote. For repair: the ledger
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
    api_key_id = func.coalesce(UsageEvent.api_key_id, none)
    session_id = func.coalesce(UsageEvent.session_id, none)
    price_id = func.coalesce(UsageEvent.price_id, literal_column("0"))
    sums = (
        select(
            UsageEvent.tenant_id,
            UsageEvent.hour,
            api_key_id,
            session_id,
            UsageEvent.base_model,
            UsageEvent.kind,
            price_id,
            func.count(),
            func.sum(UsageEvent.quantity),
            func.sum(UsageEvent.cached_quantity),
            func.sum(UsageEvent.amount_micros),
        )
        .where(*event_scope)
        .group_by(
            UsageEvent.tenant_id,
            UsageEvent.hour,
            api_key_id,
            session_id,
            UsageEvent.base_model,
            UsageEvent.kind,
            price_id,
        )
    )
    result = db.execute(
        insert(UsageRollup).from_select(
            [
                "tenant_id",
                "hour",
                "api_key_id",
                "session_id",
                "base_model",
                "kind",
                "price_id",
                "events",
                "quantity",
                "cached_quantity",
                "amount_micros",
            ],
            sums,
        )
    )
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


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
