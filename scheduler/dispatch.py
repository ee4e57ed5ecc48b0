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

if TYPE_CHECKING:
    from scheduler.worker_host import WorkerHost

log = logging.getLogger(__name__)


class Dispatcher(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...

    def wake(self) -> None:
        """New work was submitted."""
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

    def __init__(self, host_factory: Callable[[], WorkerHost], *, idle_poll_seconds: float = 0.5) -> None:
        self._host_factory = host_factory
        self._idle_poll = idle_poll_seconds
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._failure: str | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="treadle-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def wake(self) -> None:
        self._wake.set()

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    @property
    def failure(self) -> str | None:
        return self._failure

    def _run(self) -> None:
        try:
            host = self._host_factory()
        except Exception as exc:
            log.exception("the engine failed to start")
            self._failure = f"the engine failed to start ({type(exc).__name__}: {exc}); see the server log"
            self._ready.set()
            return
        self._ready.set()
        while not self._stop.is_set():
            try:
                done = host.step()
            except Exception:
                log.exception("engine step failed")
                done = 0
            if not done:
                self._wake.wait(self._idle_poll)
                self._wake.clear()
