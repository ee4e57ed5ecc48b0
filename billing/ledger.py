"""The usage ledger: the one write path for `usage_events`.

Recording is idempotent per `(operation, kind)`: a retried, redelivered or replayed operation
can call it again and nothing is counted twice. Callers record in the same transaction that
stores the operation's result, so a result never exists without its usage or vice versa.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session as OrmSession

from billing.tables import USAGE_KINDS, UsageEvent
from core.clock import Clock


@dataclass(frozen=True)
class UsageLine:
    kind: str
    quantity: int
    cached_quantity: int = 0


def record_usage(
    db: OrmSession,
    clock: Clock,
    *,
    tenant_id: str,
    session_id: str | None,
    operation_id: str,
    base_model: str,
    lines: list[UsageLine],
) -> None:
    now = clock.now()
    hour = now.replace(minute=0, second=0, microsecond=0)
    rows = []
    for line in lines:
        if line.kind not in USAGE_KINDS:
            raise ValueError(f"unknown usage kind {line.kind!r}")
        if line.quantity <= 0:
            continue
        rows.append(
            {
                "tenant_id": tenant_id,
                "session_id": session_id,
                "operation_id": operation_id,
                "kind": line.kind,
                "base_model": base_model,
                "quantity": line.quantity,
                "cached_quantity": line.cached_quantity,
                "hour": hour,
                "created_at": now,
            }
        )
    if not rows:
        return
    dialect = db.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    db.execute(
        insert(UsageEvent)
        .values(rows)
        .on_conflict_do_nothing(index_elements=["operation_id", "kind"])
    )


def usage_by_model_and_kind(
    db: OrmSession, tenant_id: str, *, since: datetime | None = None, until: datetime | None = None
) -> list[tuple[str, str, int]]:
    """The tenant's usage summed per (base model, kind) over [since, until)."""
    query = select(UsageEvent.base_model, UsageEvent.kind, func.sum(UsageEvent.quantity)).where(
        UsageEvent.tenant_id == tenant_id
    )
    if since is not None:
        query = query.where(UsageEvent.created_at >= since)
    if until is not None:
        query = query.where(UsageEvent.created_at < until)
    rows = db.execute(
        query.group_by(UsageEvent.base_model, UsageEvent.kind).order_by(
            UsageEvent.base_model, UsageEvent.kind
        )
    )
    return [(model, kind, int(total)) for model, kind, total in rows]
