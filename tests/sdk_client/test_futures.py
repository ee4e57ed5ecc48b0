"""APIFuture: blocking, awaiting, polling and mapping results."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from treadle.futures import APIFuture

pytestmark = pytest.mark.unit


def later(
    value: object, delay: float = 0.05, error: BaseException | None = None
) -> APIFuture[object]:
    future: concurrent.futures.Future[object] = concurrent.futures.Future()

    def finish() -> None:
        time.sleep(delay)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    threading.Thread(target=finish, daemon=True).start()
    return APIFuture(future)


def test_result_done_and_timeout() -> None:
    future = later(42, delay=0.2)
    assert not future.done()
    with pytest.raises(TimeoutError):
        future.result(timeout=0.01)
    assert future.result(timeout=5) == 42
    assert future.done() and future.exception() is None


def test_errors_surface_from_result_and_exception() -> None:
    future = later(None, error=ValueError("bad input"))
    with pytest.raises(ValueError, match="bad input"):
        future.result(timeout=5)
    assert isinstance(future.exception(), ValueError)


def test_await_from_any_event_loop() -> None:
    async def main() -> list[object]:
        first, second = later(1, 0.05), later(2, 0.01)
        return [await first, await second.result_async(timeout=5)]

    assert asyncio.run(main()) == [1, 2]


def test_await_timeout() -> None:
    async def main() -> None:
        await later(1, delay=1.0).result_async(timeout=0.01)

    with pytest.raises(TimeoutError):
        asyncio.run(main())


def test_map_and_callbacks() -> None:
    seen: list[object] = []
    future = later(20)
    future.add_done_callback(lambda f: seen.append(f.result()))
    assert future.map(lambda v: v + 1).result(timeout=5) == 21  # type: ignore[operator]
    assert seen == [20]
    failing = APIFuture.completed(1).map(lambda _: 1 / 0)
    assert isinstance(failing.exception(), ZeroDivisionError)
    assert APIFuture.failed(KeyError("x")).done()
