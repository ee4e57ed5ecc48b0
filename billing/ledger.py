"""The usage ledger: the one write path for operations' `usage_events`.

Each event is priced when it is recorded, at the version in force at its time, and belongs
to the UTC hour of that time. Recording is idempotent per `(operation, kind)`: a retried,
redelivered or replayed operation can call it again and nothing is counted twice — only the
events actually inserted reach the hourly rollups and the period's spend. Callers record in
the same transaction that stores the operation's result, so a result never exists without its
usage, rollups and spend, or vice versa.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import cast

from sqlalchemy import Executable, Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session as OrmSession

from billing.prices import Rate, cost_micros, rate_in_force
from billing.rollups import RolledEvent, add_to_rollups
from billing.spend import add_spend
from billing.tables import USAGE_KINDS, UsageEvent
from core.clock import Clock


@dataclass(frozen=True)
class UsageLine:
    kind: str
    quantity: int
    cached_quantity: int = 0


Rates = Callable[[OrmSession, str, str, datetime], Rate | None]
"""Finds the price version in force for (base model, kind) at a time: `rate_in_force`, or a
process's `PriceCache`."""


def _new_events(insert: Callable[[Table], postgresql.Insert | sqlite.Insert]) -> Executable:
    events = cast(Table, UsageEvent.__table__)
    return (
        insert(events)
        .on_conflict_do_nothing(index_elements=[events.c.operation_id, events.c.kind])
        .returning(
            events.c.kind,
            events.c.quantity,
            events.c.cached_quantity,
            events.c.price_id,
            events.c.amount_micros,
        )
    )


# Built once: a statement given its rows at execution is compiled once per process, where one
# holding them (`.values(rows)`) would be compiled on every call.
_NEW_EVENTS = {"postgresql": _new_events(postgresql.insert), "sqlite": _new_events(sqlite.insert)}


def record_usage(
    db: OrmSession,
    clock: Clock,
    *,
    tenant_id: str,
    api_key_id: str | None,
    session_id: str | None,
    operation_id: str,
    base_model: str,
    lines: list[UsageLine],
    rates: Rates = rate_in_force,
) -> int:
    """Record an operation's usage, priced at the version in force now, and add what was
    inserted to the hourly rollups and the tenant's spend this period; returns the amount
    recorded (0 when everything was recorded before)."""
    now = clock.now()
    hour = now.replace(minute=0, second=0, microsecond=0)
    rows = []
    for line in lines:
        if line.kind not in USAGE_KINDS:
            raise ValueError(f"unknown usage kind {line.kind!r}")
        if line.quantity <= 0:
            continue
        rate = rates(db, base_model, line.kind, now)
        rows.append(
            {
                "tenant_id": tenant_id,
                "api_key_id": api_key_id,
                "session_id": session_id,
                "operation_id": operation_id,
                "kind": line.kind,
                "base_model": base_model,
                "quantity": line.quantity,
                "cached_quantity": line.cached_quantity,
                "price_id": None if rate is None else rate.id,
                "amount_micros": cost_micros(rate, line.quantity, line.cached_quantity),
                "hour": hour,
                "created_at": now,
            }
        )
    if not rows:
        return 0
    # Only what this call inserted goes further: a replay's rows are already counted.
    inserted = db.execute(_NEW_EVENTS[db.get_bind().dialect.name], rows).all()
    if not inserted:
        return 0
    add_to_rollups(
        db,
        (
            RolledEvent(
                tenant_id=tenant_id,
                hour=hour,
                api_key_id=api_key_id,
                session_id=session_id,
                base_model=base_model,
                kind=kind,
                price_id=price_id,
                quantity=quantity,
                cached_quantity=cached,
                amount_micros=amount,
            )
            for kind, quantity, cached, price_id, amount in inserted
        ),
    )
    total = sum(amount for *_, amount in inserted)
    add_spend(db, tenant_id, now, total)
    return total
