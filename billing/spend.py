"""Spend per billing period: what a tenant has spent in one calendar month (UTC), kept in
`tenant_spend` beside the ledger so a spend limit is checked with one row read.

Only the ledger adds to it (`add_spend`, in the transaction that records the priced usage), so
the counter and the ledger's sum of `amount_micros` over the period never disagree;
`recompute_spend` rebuilds it from the ledger should it ever be damaged. It knows
nothing of limits: those read `period_spend`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import cast

from sqlalchemy import Executable, Table, delete, func, insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session as OrmSession

from billing.tables import TenantSpend, UsageEvent


def period_start(at: datetime) -> datetime:
    """The start of the billing period holding `at`: midnight UTC on the first of its month."""
    if at.tzinfo is not None:
        at = at.astimezone(UTC)
    return at.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def period_spend(db: OrmSession, tenant_id: str, at: datetime) -> int:
    """What the tenant has spent, in micro-units, in the billing period holding `at`."""
    spent = db.scalar(
        select(TenantSpend.spent_micros).where(
            TenantSpend.tenant_id == tenant_id, TenantSpend.period_start == period_start(at)
        )
    )
    return int(spent or 0)


def add_spend(db: OrmSession, tenant_id: str, at: datetime, amount_micros: int) -> None:
    """Add `amount_micros` to the tenant's spend in the period holding `at` (an upsert, so
    concurrent recorders add up instead of colliding). Nothing is written for a zero amount."""
    if amount_micros == 0:
        return
    db.execute(
        _ADD[db.get_bind().dialect.name],
        {"tenant_id": tenant_id, "period_start": period_start(at), "spent_micros": amount_micros},
    )


def _add(insert: Callable[[Table], postgresql.Insert | sqlite.Insert]) -> Executable:
    spend = cast(Table, TenantSpend.__table__)
    statement = insert(spend)
    return statement.on_conflict_do_update(
        index_elements=[spend.c.tenant_id, spend.c.period_start],
        set_={"spent_micros": spend.c.spent_micros + statement.excluded.spent_micros},
    )


# Built once and given its values at execution, so it is compiled once per process.
_ADD = {"postgresql": _add(postgresql.insert), "sqlite": _add(sqlite.insert)}


def recompute_spend(db: OrmSession, *, tenant_id: str | None = None) -> None:
    """Rebuild the spend counters (of one tenant, or all) from the ledger's amounts, replacing
    what was there. For repair: the ledger is the truth, and spend its sum per period."""
    scope = [] if tenant_id is None else [UsageEvent.tenant_id == tenant_id]
    db.execute(
        delete(TenantSpend).where(
            *([] if tenant_id is None else [TenantSpend.tenant_id == tenant_id])
        )
    )
    spent: dict[tuple[str, datetime], int] = {}
    for tenant, hour, amount in db.execute(
        select(UsageEvent.tenant_id, UsageEvent.hour, func.sum(UsageEvent.amount_micros))
        .where(*scope)
        .group_by(UsageEvent.tenant_id, UsageEvent.hour)
    ):
        key = (tenant, period_start(hour))
        spent[key] = spent.get(key, 0) + int(amount or 0)
    rows = [
        {"tenant_id": tenant, "period_start": start, "spent_micros": amount}
        for (tenant, start), amount in sorted(spent.items())
        if amount
    ]
    if rows:
        db.execute(insert(TenantSpend), rows)
