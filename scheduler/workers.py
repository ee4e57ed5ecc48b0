"""Worker rows: the one place they are written, and who counts as alive.

A worker is alive while its lease holds: it renews the lease every few seconds, and beat
declares a worker whose lease lapsed dead. A live worker asked to drain keeps its runs (it is
still alive) but takes no new placements, until it hands them over and leaves. Each function
takes the caller's session (the caller owns the transaction).
"""

from __future__ import annotations

import socket
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session as OrmSession

from core.tables import Worker, WorkerStatus

# Statuses of a worker that holds what is placed on it (while its lease holds).
HOLDING = (WorkerStatus.LIVE, WorkerStatus.DRAINING)


def register(
    db: OrmSession,
    worker_id: str,
    *,
    device: str,
    models: list[dict[str, Any]],
    lease_until: datetime,
    now: datetime,
    group_size: int = 1,
) -> None:
    """Record a worker (new or restarted), what it serves, its size (ranks of a worker group,
    1 for one device), and its first lease."""
    worker = db.get(Worker, worker_id) or Worker(id=worker_id, registered_at=now)
    worker.hostname = socket.gethostname()
    worker.device = device
    worker.models = models
    worker.group_size = group_size
    worker.status, worker.lease_expires_at = WorkerStatus.LIVE, lease_until
    worker.left_at = None
    db.merge(worker)


def renew(
    db: OrmSession, worker_id: str, *, lease_until: datetime, held_runs: int, adapter_bytes: int
) -> WorkerStatus | None:
    """Extend a live or draining worker's lease and record what it holds; returns its status
    (dead: declared dead meanwhile, then it must stop; left: it is leaving), None for a worker
    never registered."""
    worker = db.get(Worker, worker_id)
    if worker is None:
        return None
    if worker.status in HOLDING:
        worker.lease_expires_at = lease_until
        worker.held_runs, worker.adapter_bytes = held_runs, adapter_bytes
    return WorkerStatus(worker.status)


def request_drain(db: OrmSession, worker_id: str, now: datetime) -> None:
    """Ask a live worker to drain: placement skips it from now on, and the worker, seeing the
    status at its next lease renewal, stops and hands its runs over. Asking twice is harmless.
    One conditional update, so a worker beat declares dead meanwhile stays dead. Raises
    LookupError, with the reason, for a worker that is not alive."""
    changed = db.execute(
        update(Worker)
        .where(Worker.id == worker_id, Worker.status.in_(HOLDING), Worker.lease_expires_at > now)
        .values(status=WorkerStatus.DRAINING)
        .execution_options(synchronize_session=False)
    ).rowcount  # type: ignore[attr-defined]
    if changed:
        return
    worker = db.get(Worker, worker_id)
    if worker is None:
        raise LookupError(
            f"no worker has id {worker_id!r}; `treadle-server admin workers` lists them"
        )
    raise LookupError(f"worker {worker_id} is {_state(worker, now)}: only a live worker can drain")


def leave(db: OrmSession, worker_id: str, now: datetime) -> bool:
    """Mark a worker that is handing its runs over as gone, on purpose (not dead); False when
    it is no longer live or draining (beat declared it dead first), and then nothing changes."""
    changed = db.execute(
        update(Worker)
        .where(Worker.id == worker_id, Worker.status.in_(HOLDING))
        .values(status=WorkerStatus.LEFT, left_at=now, lease_expires_at=now)
        .execution_options(synchronize_session=False)
    ).rowcount  # type: ignore[attr-defined]
    return bool(changed)


def declare_dead_lapsed(db: OrmSession, now: datetime) -> list[str]:
    """Declare dead the live (or draining) workers whose lease lapsed; returns their ids."""
    dead = list(
        db.scalars(
            select(Worker.id).where(Worker.status.in_(HOLDING), Worker.lease_expires_at <= now)
        )
    )
    if dead:
        db.execute(update(Worker).where(Worker.id.in_(dead)).values(status=WorkerStatus.DEAD))
    return dead


def live(db: OrmSession, now: datetime) -> list[Worker]:
    """Workers holding a lease now and taking placements (not draining)."""
    return list(
        db.scalars(
            select(Worker).where(Worker.status == WorkerStatus.LIVE, Worker.lease_expires_at > now)
        )
    )


def is_alive(db: OrmSession, worker_id: str, now: datetime) -> bool:
    """Whether the worker holds a lease now: what is placed on it stays there (a draining
    worker too, until it hands its runs over)."""
    worker = db.get(Worker, worker_id)
    return worker is not None and worker.status in HOLDING and worker.lease_expires_at > now


def _state(worker: Worker, now: datetime) -> str:
    if worker.status in HOLDING and worker.lease_expires_at <= now:
        return "not renewing its lease (the embedded server's, or one beat will declare dead)"
    return worker.status
