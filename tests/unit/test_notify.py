"""InProcessNotifier's progress channel: watches registered before publishing get every message,
in order, on their own event loop, from any thread; unwatched or other ops' watches get none."""

from __future__ import annotations

import asyncio
import threading

import pytest

from scheduler.notify import InProcessNotifier, Progress

pytestmark = pytest.mark.unit


def test_a_watch_receives_progress_published_from_another_thread_in_order() -> None:
    notifier = InProcessNotifier()
    messages: list[Progress] = [{0: (0, [5, 6]), 1: (0, [7])}, {0: (2, [8])}, {1: (1, [9, 10])}]

    async def scenario() -> list[Progress | None]:
        watch = notifier.watch_progress("op-1")
        other = notifier.watch_progress("op-2")
        publisher = threading.Thread(
            target=lambda: [notifier.publish_progress("op-1", m) for m in messages]
        )
        publisher.start()
        received = [await watch.next(timeout=30) for _ in messages]
        publisher.join()
        assert await other.next(timeout=0.01) is None
        notifier.unwatch_progress(watch)
        notifier.unwatch_progress(other)
        return received

    assert asyncio.run(scenario()) == messages


def test_every_watch_of_an_op_receives_it_and_an_unwatched_one_none() -> None:
    notifier = InProcessNotifier()

    async def scenario() -> None:
        first, second = notifier.watch_progress("op"), notifier.watch_progress("op")
        notifier.publish_progress("op", {0: (0, [1])})
        assert await first.next(timeout=30) == {0: (0, [1])}
        assert await second.next(timeout=30) == {0: (0, [1])}
        notifier.unwatch_progress(first)
        notifier.publish_progress("op", {0: (1, [2])})
        assert await second.next(timeout=30) == {0: (1, [2])}
        assert await first.next(timeout=0.01) is None
        notifier.unwatch_progress(second)
        notifier.unwatch_progress(second)  # a second unwatch is harmless
        notifier.publish_progress("op", {0: (2, [3])})  # nobody watches: dropped, no error

    asyncio.run(scenario())


def test_publishing_to_a_watch_whose_loop_has_closed_is_harmless() -> None:
    notifier = InProcessNotifier()

    async def watch_and_leave() -> None:
        notifier.watch_progress("op")

    asyncio.run(watch_and_leave())
    notifier.publish_progress("op", {0: (0, [1])})


def test_a_cancelled_next_either_returns_its_message_or_leaves_it() -> None:
    notifier = InProcessNotifier()

    async def scenario() -> None:
        watch = notifier.watch_progress("op")
        waiting = asyncio.ensure_future(watch.next(timeout=30))
        await asyncio.sleep(0)  # `waiting` now waits for a message
        notifier.publish_progress("op", {0: (0, [1])})
        await asyncio.sleep(0)  # the message arrives and wakes `waiting`...
        waiting.cancel()  # ...which is cancelled before it could resume and take it
        try:
            taken = await waiting  # a wait that had already ended may still return its message
        except asyncio.CancelledError:
            taken = await watch.next(timeout=30)
        assert taken == {0: (0, [1])}
        assert await watch.next(timeout=0.01) is None
        notifier.unwatch_progress(watch)

    asyncio.run(scenario())
