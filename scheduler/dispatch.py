"""Getting submitted operations to an engine.

`Dispatcher` is the seam between the API and wherever ops execute. Embedded mode runs one
engine thread in the API process (`scheduler.worker.embedded`, which imports the engine
and torch on that thread only); distributed mode routes ops to worker processes
(`CeleryDispatcher`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from sqlalchemy.orm import Session as OrmSession

from core.clock import Clock
from core.logs import Outage
from core.settings import Settings
from scheduler.celery_app import RUN_READY_TASK, worker_queue
from scheduler.placement import place

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger(__name__)
# Every submission and beat tick wakes a worker: an outage of the broker is logged when it starts
# and ends, not on each of them.
_waking = Outage(
    log, "waking workers through Redis", "workers find new work on their next poll instead"
)


class Dispatcher(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...

    def assign(self, db: OrmSession, target_id: str) -> str | None:
        """Inside the transaction that submits work for `target_id` (a training run or sampling
        session): the worker that runs it, placing it first when no live worker holds it; None
        when no worker can take it yet, or when one engine runs everything (embedded mode)."""
        ...

    def wake(self, worker_id: str | None = None) -> None:
        """New work was submitted, for `worker_id` when it was assigned one."""
        ...

    def wait_ready(self, timeout: float) -> bool:
        """Block until ops can execute (models registered); False on timeout."""
        ...

    @property
    def failure(self) -> str | None:
        """Why the dispatcher cannot run ops, if it cannot."""
        ...


class CeleryDispatcher:
    """Distributed mode: place the target on a live worker (in the submitting transaction, and
    only when no live worker holds it) and wake that worker through its own queue.

    The message carries no work, only "look at the database": workers claim ops from there, so
    a duplicated or lost message costs nothing but a poll.
    """

    def __init__(self, settings: Settings, clock: Clock) -> None:
        from scheduler.celery_app import make_celery

        self._settings = settings
        self._clock = clock
        self._celery = make_celery(settings)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def wait_ready(self, timeout: float) -> bool:
        return True

    @property
    def failure(self) -> str | None:
        return None

    def assign(self, db: OrmSession, target_id: str) -> str | None:
        worker_id = place(db, self._settings, self._clock.now(), target_id)
        if worker_id is None:
            log.info("no live worker can take %s yet; its ops wait", target_id)
        return worker_id

    def wake(self, worker_id: str | None = None) -> None:
        if worker_id is not None:
            wake_worker(self._celery, worker_id)


def wake_worker(celery: Celery, worker_id: str) -> None:
    try:
        celery.send_task(RUN_READY_TASK, args=[worker_id], queue=worker_queue(worker_id))
    except Exception as exc:
        _waking.failed(exc)
        return
    _waking.succeeded()
