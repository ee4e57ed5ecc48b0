"""A private asyncio event loop on a daemon thread, where all of a client's requests run.

Synchronous callers hand coroutines to it and get `concurrent.futures.Future`s back, so one
httpx connection pool serves every request of a ServiceClient whatever thread calls it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from treadle.errors import ClientClosedError, UsageError

T = TypeVar("T")


class BackgroundLoop:
    """An event loop running forever on its own daemon thread until `close()`."""

    def __init__(self, name: str = "treadle-loop") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def spawn(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop; its result arrives in the returned future."""
        if self._loop.is_closed():
            coro.close()
            raise ClientClosedError("this client is closed; create a new ServiceClient")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and block until it finishes (not from the loop itself)."""
        if self.in_loop_thread():
            coro.close()
            raise UsageError(
                "a blocking treadle call was made from the client's own event loop; "
                "use the *_async variant instead"
            )
        return self.spawn(coro).result(timeout)

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` on the background loop from any other event loop."""
        return await asyncio.wrap_future(self.spawn(coro))

    def close(self, timeout: float = 10.0) -> None:
        """Cancel what still runs, stop the loop and join its thread."""
        if self._loop.is_closed():
            return

        async def _cancel_all() -> None:
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive() and not self.in_loop_thread():
            with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
                asyncio.run_coroutine_threadsafe(_cancel_all(), self._loop).result(timeout)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        if not self._loop.is_running():
            self._loop.close()
