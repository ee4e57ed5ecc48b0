"""The record of parts meant for Stripe, in `stripe_meter_pushes`: what the pusher intends to
send, and what Stripe accepted.

A part is written as *intended* (its identifier and value fixed) in a committed transaction
before it is sent, and marked *accepted* after Stripe's answer. A part intended and never
marked accepted may or may not be held by Stripe (the push died before or after sending it),
so it is sent again exactly as intended; a cell's next part is computed against every part
recorded, intended or accepted, so usage recorded later always goes under a new identifier.

This module knows nothing of Stripe's API or of the ledger; `billing.stripe_push` decides what
to send and sends it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session as OrmSession

from billing.stripe_gateway import MAX_IDENTIFIER_LENGTH
from billing.tables import StripeMeterPush
from core.clock import Clock
from core.db import Database
from core.errors import NotFound


@dataclass(frozen=True, order=True)
class Cell:
    tenant_id: str
    kind: str
    hour: datetime
    price_id: int


@dataclass(frozen=True)
class PendingPush:
    """A part of a cell to send: `value` micro-units as part `part` of `cell`."""

    cell: Cell
    stripe_customer_id: str
    part: int
    value: int
    identifier: str


@dataclass(frozen=True)
class Intent:
    """A part recorded as intended and not marked accepted, and when it was intended."""

    push: PendingPush
    intended_at: datetime


def push_identifier(cell: Cell, part: int) -> str:
    """Deterministic, so a repeated push is recognized by Stripe. One too long for Stripe (a
    tenant id far longer than Treadle makes) is shortened to a digest of itself."""
    full = f"treadle-{cell.tenant_id}-{cell.kind}-{cell.hour:%Y%m%dT%H}-p{cell.price_id}-{part}"
    if len(full) <= MAX_IDENTIFIER_LENGTH:
        return full
    return f"treadle-{hashlib.sha256(full.encode()).hexdigest()}"


def recorded_cells(
    db: OrmSession, tenant_id: str, since: datetime, before: datetime
) -> dict[Cell, tuple[int, int]]:
    """Every part recorded per cell for hours in [since, before), intended or accepted: (their
    value, the cell's next part number)."""
    rows = db.execute(
        select(
            StripeMeterPush.kind,
            StripeMeterPush.hour,
            StripeMeterPush.price_id,
            func.sum(StripeMeterPush.value_micros),
            func.max(StripeMeterPush.part),
        )
        .where(
            StripeMeterPush.tenant_id == tenant_id,
            StripeMeterPush.hour >= since,
            StripeMeterPush.hour < before,
        )
        .group_by(StripeMeterPush.kind, StripeMeterPush.hour, StripeMeterPush.price_id)
    )
    return {
        Cell(tenant_id, kind, hour, int(price_id)): (int(total), int(last) + 1)
        for kind, hour, price_id, total, last in rows
    }


def unaccepted(db: OrmSession) -> list[Intent]:
    """The parts intended and not marked accepted, oldest first."""
    rows = db.scalars(
        select(StripeMeterPush)
        .where(StripeMeterPush.accepted_at.is_(None))
        .order_by(StripeMeterPush.intended_at, StripeMeterPush.identifier)
    )
    return [Intent(_push_of(row), row.intended_at) for row in rows]


def intend(database: Database, clock: Clock, pushes: list[PendingPush]) -> list[PendingPush]:
    """Record `pushes` as intended, in one committed transaction; the ones recorded now.

    A part some other pusher intended first (pushers in separate processes on SQLite do not
    share a lock) is left out: it is that pusher's to send, with its value.
    """
    if not pushes:
        return []
    now = clock.now()
    rows = [
        {
            "identifier": push.identifier,
            "tenant_id": push.cell.tenant_id,
            "stripe_customer_id": push.stripe_customer_id,
            "kind": push.cell.kind,
            "hour": push.cell.hour,
            "price_id": push.cell.price_id,
            "part": push.part,
            "value_micros": push.value,
            "intended_at": now,
            "accepted_at": None,
        }
        for push in pushes
    ]
    insert = postgresql.insert if not database.is_sqlite else sqlite.insert
    with database.transaction() as db:
        recorded = set(
            db.scalars(
                insert(StripeMeterPush)
                .values(rows)
                .on_conflict_do_nothing()
                .returning(StripeMeterPush.identifier)
            )
        )
    return [push for push in pushes if push.identifier in recorded]


def settle(
    database: Database, clock: Clock, accepted: list[PendingPush], refused: list[PendingPush]
) -> None:
    """Mark the parts Stripe accepted, and forget the ones it refused for good: it holds
    nothing under their identifiers, so the next push computes their cells anew."""
    if not accepted and not refused:
        return
    with database.transaction() as db:
        if accepted:
            db.execute(
                update(StripeMeterPush)
                .where(
                    StripeMeterPush.identifier.in_([push.identifier for push in accepted]),
                    StripeMeterPush.accepted_at.is_(None),
                )
                .values(accepted_at=clock.now())
            )
        if refused:
            db.execute(
                delete(StripeMeterPush).where(
                    StripeMeterPush.identifier.in_([push.identifier for push in refused]),
                    StripeMeterPush.accepted_at.is_(None),
                )
            )


def resolve(database: Database, clock: Clock, identifier: str, *, held: bool) -> PendingPush:
    """Settle an unconfirmed part by hand, once the reconciler showed whether Stripe holds it:
    `held` marks it accepted; otherwise it is forgotten and the next push sends its value again
    as a new part. Raises `NotFound` when no part with that identifier awaits acceptance."""
    with database.transaction() as db:
        row = db.scalar(
            select(StripeMeterPush)
            .where(StripeMeterPush.identifier == identifier, StripeMeterPush.accepted_at.is_(None))
            .with_for_update()
        )
        if row is None:
            raise NotFound(
                f"no Stripe meter event {identifier!r} awaits acceptance; "
                "`treadle-server admin billing push` lists the unconfirmed ones"
            )
        push = _push_of(row)
        if held:
            row.accepted_at = clock.now()
        else:
            db.delete(row)
    return push


def _push_of(row: StripeMeterPush) -> PendingPush:
    return PendingPush(
        Cell(row.tenant_id, row.kind, row.hour, row.price_id),
        row.stripe_customer_id,
        row.part,
        row.value_micros,
        row.identifier,
    )
