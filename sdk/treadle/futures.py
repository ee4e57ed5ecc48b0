"""`APIFuture`: the handle every GPU-bound call returns at once.

The work behind a future runs on the client's background event loop (submission, then
long-polling `/retrieve_future`). The caller waits however suits it: `future.result()` from
synchronous code, `await future` from asyncio code (on any event loop), or `done()` to check.

This module knows nothing of HTTP; `treadle._polling` fills the futures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")


class APIFuture(Generic[T]):
    """The eventual result of a request; backed by a `concurrent.futures.Future`.

    Waiting is never serialised: several futures of one client may be waited on in any order,
    from any thread or event loop.
    """

    def __init__(
        self,
        future: concurrent.futures.Future[T],
        usage: Callable[[], dict[str, int] | None] | None = None,
    ) -> None:
        self._future = future
        self._usage = usage

    @property
    def usage(self) -> dict[str, int] | None:
        """The billed quantities of this request by usage kind, once its result has arrived.

        The server's ledger entries for the operation and what they cost, e.g.
        `{"training": 120, "cost_micros": 26}` for a forward_backward,
        `{"sampling_prefill": 5, "sampling_sample": 32, "cost_micros": 7}` for a sample,
        `{"checkpoint": 1, "cost_micros": 0}` for a save and `{}` for an `optim_step`
        (docs/protocol.md lists what each call bills). `cost_micros` is in micro-units of the
        currency (1e-6). For a result assembled from several requests (a batch split into
        chunks, `forward_backward_custom`'s two passes) it is their sum.

        Returns:
            A new dict of kind -> quantity (and `cost_micros`); None while the result is
            pending, when the request failed, or when the server sent no usage (a server
            without this feature).
        """
        if self._usage is None or not self._future.done() or self._future.cancelled():
            return None
        if self._future.exception() is not None:
            return None
        return self._usage()

    @property
    def cost_micros(self) -> int | None:
        """What this request cost, in micro-units of the currency (1e-6), once its result has
        arrived; None when `usage` is None or the server sent no cost."""
        usage = self.usage
        return None if usage is None else usage.get("cost_micros")

    @classmethod
    def completed(cls, value: T) -> APIFuture[T]:
        """A future that already holds `value`."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        future.set_result(value)
        return cls(future)

    @classmethod
    def failed(cls, error: BaseException) -> APIFuture[T]:
        """A future that already holds `error`."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        future.set_exception(error)
        return cls(future)

    def result(self, timeout: float | None = None) -> T:
        """Block until the result is there and return it.

        Args:
            timeout: seconds to wait; None waits as long as it takes.

        Raises:
            TimeoutError: the result did not arrive within `timeout` (the request goes on).
            treadle.errors.TreadleError: the request failed (the subclass says how).
        """
        return self._future.result(timeout)

    async def result_async(self, timeout: float | None = None) -> T:
        """Await the result from any event loop; same errors as `result`."""
        wrapped = asyncio.wrap_future(self._future)
        if timeout is None:
            return await wrapped
        return await asyncio.wait_for(asyncio.shield(wrapped), timeout)

    def __await__(self) -> Generator[Any, None, T]:
        return asyncio.wrap_future(self._future).__await__()

    def done(self) -> bool:
        """True once the result or an error is there."""
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error the request failed with (None if it succeeded); blocks like `result`."""
        return self._future.exception(timeout)

    def add_done_callback(self, callback: Callable[[APIFuture[T]], object]) -> None:
        """Call `callback(self)` once done (on the thread that completes the future)."""
        self._future.add_done_callback(lambda _: callback(self))

    def map(self, fn: Callable[[T], U]) -> APIFuture[U]:
        """A future of `fn(result)`; an error (also one raised by `fn`) passes through, and
        `usage` is this future's."""
        mapped: concurrent.futures.Future[U] = concurrent.futures.Future()

        def relay(source: concurrent.futures.Future[T]) -> None:
            error = source.exception()
            if error is not None:
                mapped.set_exception(error)
                return
            try:
                mapped.set_result(fn(source.result()))
            except BaseException as exc:
                mapped.set_exception(exc)

        self._future.add_done_callback(relay)
        return APIFuture(mapped, self._usage)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<APIFuture {state}>"
