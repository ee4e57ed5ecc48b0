"""The audit log: who did what to a tenant's keys, limits and checkpoints. Append-only; the
row is written in the transaction that makes the change, so the log never claims a change that
rolled back."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session as OrmSession

from core.clock import Clock
from core.tables import AuditLog


def record(
    db: OrmSession,
    clock: Clock,
    *,
    tenant_id: str | None,
    actor: str,
    action: str,
    target: str | None = None,
    detail: dict[str, Any] | None = None,
) -> None:
    """`actor` is who acted: an API key id, or "operator" for the admin CLI. `action` is a
    dotted name such as "api_key.created" or "checkpoint.published"."""
    db.add(
        AuditLog(
            tenant_id=tenant_id,
            actor=actor,
            action=action,
            target=target,
            detail=detail,
            created_at=clock.now(),
        )
    )


def entries(
    db: OrmSession,
    tenant_id: str,
    since: datetime,
    until: datetime,
    *,
    action_prefixes: Sequence[str] | None = None,
) -> list[AuditLog]:
    """The tenant's entries written in [since, until), oldest first; with `action_prefixes`,
    only actions starting with one of them (an empty sequence: none)."""
    query = select(AuditLog).where(
        AuditLog.tenant_id == tenant_id, AuditLog.created_at >= since, AuditLog.created_at < until
    )
    if action_prefixes is not None:
        if not action_prefixes:
            return []
        query = query.where(or_(*(AuditLog.action.startswith(p) for p in action_prefixes)))
    return list(db.scalars(query.order_by(AuditLog.created_at, AuditLog.id)))
