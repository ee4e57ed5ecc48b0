"""RedisNotifier against a real Redis: progress published by one notifier (a worker's) reaches a
watch on another (an API process's) through the listener thread, with integer keys and token
lists intact, beside completions; with Redis unreachable, publishing neither raises nor blocks
repeatedly."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest

from scheduler.notify import Progress, RedisNotifier

pytestmark = pytest.mark.integration


def test_progress_and_completion_cross_processes_through_redis(redis_url: str) -> None:
    worker, api = RedisNotifier(redis_url), RedisNotifier(redis_url)
    op_id = f"op-{uuid.uuid4()}"
    messages: list[Progress] = [{0: (0, [1, 2]), 3: (0, [40])}, {0: (2, [3])}]

    async def scenario() -> None:
        watch = api.watch_progress(op_id)
        finished = api.subscribe(op_id)
        api.start_listening()
        try:
            # The listener subscribes asynchronously: publish until the first message arrives.
            first = None
            while first is None:
                worker.publish_progress(op_id, messages[0])
                first = await watch.next(timeout=0.2)
            assert first == messages[0]
            while (extra := await watch.next(timeout=0.2)) == messages[0]:
                pass  # repeats of the first message sent while the listener was subscribing
            assert extra is None
            worker.publish_progress(op_id, messages[1])
            worker.publish_progress(f"op-{uuid.uuid4()}", {0: (0, [9])})
            assert await watch.next(timeout=30) == messages[1]
            worker.publish(op_id)
            await asyncio.wait_for(finished.wait(), timeout=30)
            assert await watch.next(timeout=0.2) is None
        finally:
            api.unwatch_progress(watch)
            api.unsubscribe(op_id, finished)
            api.stop()

    asyncio.run(scenario())


def test_publishing_without_redis_warns_once_and_never_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    notifier = RedisNotifier("redis://127.0.0.1:1")
    with caplog.at_level(logging.WARNING, logger="scheduler.notify"):
        notifier.publish_progress("op", {0: (0, [1])})
        notifier.publish_progress("op", {0: (1, [2])})  # within the back-off: not even tried
        notifier.publish("op")
        notifier.publish("op")
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
