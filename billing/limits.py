"""Spend limits: a tenant's per billing period (a calendar month, UTC) and per session.

At submission an op that costs something is admitted while what was spent plus what is
reserved stays below each limit that applies; its estimate (`billing.estimate`) is then
reserved on the op (`operations.reserved_micros`). Reserved is the sum over the queued and
running ops, so settlement needs no write: an op that is done or failed no longer counts, and
its real cost is in the spend the ledger kept in the same transaction. The check runs with the
tenant's row locked (see `core.tenants.lock_tenant`), so concurrent submissions see each
other's reservations and only the op that crosses a limit goes beyond it.

Over a limit, every op checked here is refused, the free ones too (an optim_step admitted
while the forward_backward before it waits out its refusal would only stall its run behind the
gap), except one that fills a gap below a seq its training run already accepted: refusing it
would stall the run's later ops. The callers leave unchecked what must never wait on money:
creating or loading a run, unloading it, and a request refused on its content.

It knows nothing of HTTP: over a limit it raises `SpendLimitReached`, which the API answers
with 402.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session as OrmSession

from billing.estimate import Estimate, estimate_micros
from billing.spend import period_spend, period_start
from billing.tables import UsageRollup
from core.clock import Clock
from core.errors import SpendLimitReached
from core.tables import Operation, OpStatus, Tenant

_IN_FLIGHT = (OpStatus.QUEUED, OpStatus.RUNNING)


def has_limit(tenant: Tenant) -> bool:
    return tenant.spend_limit_micros is not None or tenant.session_spend_limit_micros is not None


def reserve(
    db: OrmSession,
    clock: Clock,
    tenant: Tenant,
    *,
    session_id: str,
    target_id: str,
    run_seq_id: int | None,
    estimate: Estimate,
) -> int:
    """The micro-units to reserve on a new op of `tenant` (its row locked by the caller), after
    checking its limits. `run_seq_id` is the op's place in its training run's order (None for
    sampling, which has no order).

    Raises:
        SpendLimitReached: the tenant's or the session's spend plus reservations has reached
            its limit, and the op does not fill a gap of its run.
    """
    if not has_limit(tenant):
        return 0
    now = clock.now()
    cost = estimate_micros(db, clock, estimate)
    refusal = _over_tenant_limit(db, tenant, now) or _over_session_limit(db, tenant, session_id)
    if refusal is not None and not _fills_gap(db, target_id, run_seq_id):
        raise SpendLimitReached(refusal)
    return cost


def _reserved(db: OrmSession, *where: ColumnElement[bool]) -> int:
    total = db.scalar(
        select(func.coalesce(func.sum(Operation.reserved_micros), 0)).where(
            Operation.status.in_(_IN_FLIGHT), *where
        )
    )
    return int(total or 0)


def _over_tenant_limit(db: OrmSession, tenant: Tenant, now: datetime) -> str | None:
    limit = tenant.spend_limit_micros
    if limit is None:
        return None
    spent = period_spend(db, tenant.id, now)
    reserved = _reserved(db, Operation.tenant_id == tenant.id)
    if spent + reserved < limit:
        return None
    start = period_start(now)
    following = (
        start.replace(year=start.year + 1, month=1)
        if start.month == 12
        else (start.replace(month=start.month + 1))
    )
    return (
        f"spend limit reached: tenant {tenant.name!r} has spent {dollars(spent)} "
        f"(and {dollars(reserved)} is held for work in flight) of its {dollars(limit)} limit "
        f"for the billing period {start:%Y-%m} (UTC); work already accepted finishes. Ask the "
        f"operator to raise the limit (`treadle-server admin tenants set-limit {tenant.name} "
        f"--monthly DOLLARS`), or wait for the next period, which starts {following:%Y-%m-%d}"
    )


def _over_session_limit(db: OrmSession, tenant: Tenant, session_id: str) -> str | None:
    limit = tenant.session_spend_limit_micros
    if limit is None:
        return None
    spent = session_spend(db, session_id)
    reserved = _reserved(db, Operation.session_id == session_id)
    if spent + reserved < limit:
        return None
    return (
        f"session spend limit reached: session {session_id} has spent {dollars(spent)} (and "
        f"{dollars(reserved)} is held for work in flight) of the {dollars(limit)} each session "
        f"of tenant {tenant.name!r} may spend; work already accepted finishes. Start a new "
        "session, or ask the operator to raise the limit (`treadle-server admin tenants "
        f"set-limit {tenant.name} --per-session DOLLARS`)"
    )


def session_spend(db: OrmSession, session_id: str) -> int:
    """What a session has spent over its life, in micro-units (from the hourly rollups)."""
    total = db.scalar(
        select(func.coalesce(func.sum(UsageRollup.amount_micros), 0)).where(
            UsageRollup.session_id == session_id
        )
    )
    return int(total or 0)


GAP_FILL_SPAN = 64
"""How far below a waiting op a refused-over-the-limit op may sit and still be admitted: the
chunks of one large `forward_backward` call, which the tinker SDK sends out of order, stay well
within it. The bound keeps an op parked far ahead from opening the run to unlimited spend."""


def _fills_gap(db: OrmSession, target_id: str, seq_id: int | None) -> bool:
    """True when the op's run holds a queued op at most `GAP_FILL_SPAN` seqs later, waiting for
    this one: refusing it would stall that op until its gap is given up."""
    if seq_id is None:
        return False
    waiting = select(Operation.id).where(
        Operation.target_id == target_id,
        Operation.status == OpStatus.QUEUED,
        Operation.seq_id > seq_id,
        Operation.seq_id <= seq_id + GAP_FILL_SPAN,
    )
    return db.scalar(waiting.limit(1)) is not None


def dollars(micros: int) -> str:
    """`micros` as dollars, with cents always and finer digits when they are not zero."""
    sign = "-" if micros < 0 else ""
    whole, fraction = divmod(abs(micros), 10**6)
    digits = f"{fraction:06d}".rstrip("0").ljust(2, "0")
    return f"{sign}${whole:,}.{digits}"
