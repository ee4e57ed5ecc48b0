"""Getting submitted operations to an engine.

`Dispatcher` is the seam between the API and wherever ops execute. Embedded mode runs one
engine thread in the API process (`EmbeddedDispatcher`); distributed mode routes ops to worker
processes. The engine and torch are imported inside the engine thread, so the API itself never
loads them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from sqlalchemy.orm import Session as OrmSession

from core.clock import Clock
from core.settings import Settings
from scheduler.celery_app import RUN_READY_TASK, worker_queue
from scheduler.placement import place

if TYPE_CHECKING:
    from celery import Celery

    from scheduler.worker_host import WorkerHost

log = logging.getLogger(__name__)


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


class EmbeddedDispatcher:
    """One engine thread: claims ready ops, runs them, records results, sleeps until woken."""

    def __init__(
        self, host_factory: Callable[[], WorkerHost], *, idle_poll_seconds: float = 0.5
    ) -> None:
        self._host_factory = host_factory
        self._idle_poll = idle_poll_seconds
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._failure: str | None = None
        self._thread: threading.Thread | None = None
        self._host: WorkerHost | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="treadle-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def assign(self, db: OrmSession, target_id: str) -> str | None:
        return None

    def wake(self, worker_id: str | None = None) -> None:
        self._wake.set()

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    @property
    def failure(self) -> str | None:
        return self._failure

    @property
    def host(self) -> WorkerHost | None:
        """The engine's host once started: what it holds can be inspected in-process."""
        return self._host

    def _run(self) -> None:
        try:
            host = self._host_factory()
        except Exception as exc:
            log.exception("the engine failed to start")
            self._failure = (
                f"the engine failed to start ({type(exc).__name__}: {exc}); see the server log"
            )
            self._ready.set()
            return
        self._host = host
        self._ready.set()
        while not self._stop.is_set():
            try:
                host.work()  # until nothing is ready
            except Exception:
                log.exception("engine step failed")
            # A wake-up that came after work() last looked is still set: no wait then.
            self._wake.wait(self._idle_poll)
            self._wake.clear()


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
    except Exception:
        log.warning("could not wake worker %s; it will find the work on its next poll", worker_id)
