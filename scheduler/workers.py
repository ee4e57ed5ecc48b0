"""Worker rows: the one place they are written, and who counts as alive.

A worker is alive while its lease holds: it renews the lease every few seconds, and beat
declares a worker whose lease lapsed dead. Each function takes the caller's session (the caller
owns the transaction).
"""

from __future__ import annotations

import socket
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session as OrmSession

from core.tables import Worker, WorkerStatus


def register(
    db: OrmSession,
    worker_id: str,
    *,
    device: str,
    models: list[dict[str, Any]],
    lease_until: datetime,
    now: datetime,
) -> None:
    """Record a worker (new or restarted), what it serves, and its first lease."""
    worker = db.get(Worker, worker_id) or Worker(id=worker_id, registered_at=now)
    worker.hostname = socket.gethostname()
    worker.device = device
    worker.models = models
    worker.status, worker.lease_expires_at = WorkerStatus.LIVE, lease_until
    db.merge(worker)


def renew(
    db: OrmSession, worker_id: str, *, lease_until: datetime, held_runs: int, adapter_bytes: int
) -> bool:
    """Extend a live worker's lease and record what it holds; False when it was declared dead
    meanwhile (then it must stop)."""
    worker = db.get(Worker, worker_id)
    if worker is None or worker.status != WorkerStatus.LIVE:
        return False
    worker.lease_expires_at = lease_until
    worker.held_runs, worker.adapter_bytes = held_runs, adapter_bytes
    return True


def declare_dead_lapsed(db: OrmSession, now: datetime) -> list[str]:
    """Declare dead the live workers whose lease lapsed; returns their ids."""
    dead = list(
        db.scalars(
            select(Worker.id).where(
                Worker.status == WorkerStatus.LIVE, Worker.lease_expires_at <= now
            )
        )
    )
    if dead:
        db.execute(update(Worker).where(Worker.id.in_(dead)).values(status=WorkerStatus.DEAD))
    return dead


def live(db: OrmSession, now: datetime) -> list[Worker]:
    """Workers holding a lease now."""
    return list(
        db.scalars(
            select(Worker).where(Worker.status == WorkerStatus.LIVE, Worker.lease_expires_at > now)
        )
    )


def is_alive(db: OrmSession, worker_id: str, now: datetime) -> bool:
    worker = db.get(Worker, worker_id)
    return (
        worker is not None and worker.status == WorkerStatus.LIVE and worker.lease_expires_at > now
    )
