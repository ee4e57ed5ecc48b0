"""Embedded mode's dispatcher: the engine on a thread of the API process."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session as OrmSession

from core.clock import Clock
from core.db import Database
from core.objectstore import ArtifactStore
from core.settings import Settings
from scheduler.notify import Notifier

if TYPE_CHECKING:
    from scheduler.worker.host import WorkerHost

log = logging.getLogger(__name__)


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
        if self._host is not None:
            self._host.close()  # returns once the engine thread's current step ended
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
            # Cleared before draining: a wake-up that comes while drain() runs stays set, so
            # the next wait returns at once (cleared after the wait, it could be lost).
            self._wake.clear()
            try:
                host.drain()  # until nothing is ready
            except Exception:
                log.exception("engine step failed")
            self._wake.wait(self._idle_poll)


def embedded_dispatcher(
    settings: Settings, database: Database, clock: Clock, notifier: Notifier, store: ArtifactStore
) -> EmbeddedDispatcher:
    def build_host() -> WorkerHost:
        # Imported here, on the engine thread: the API process must not load torch at import.
        from scheduler.worker.host import start_host

        return start_host(
            settings,
            database,
            clock,
            store,
            notifier,
            worker_id="embedded",
            models=settings.models,
            distributed=False,
        )

    return EmbeddedDispatcher(build_host)
