"""The audit log: who did what to a tenant's keys, limits and checkpoints. Append-only; the
row is written in the transaction that makes the change, so the log never claims a change that
rolled back."""

from __future__ import annotations

from typing import Any

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
