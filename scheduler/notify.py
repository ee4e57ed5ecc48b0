"""Wake-ups for long-polls: "operation X finished" from where it ran to whoever waits on it,
and the tokens a streamed sample op has chosen so far, for whoever streams them.

The database is the truth; a notification only says "look again". Losing one costs a waiter
at most one poll interval, and a lost progress message only delays text until the op's recorded
result fills it in. In-process here; distributed mode publishes through Redis.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import threading
import time
from typing import Any, Protocol

from core.logs import Outage

log = logging.getLogger(__name__)

Progress = dict[int, tuple[int, list[int]]]
"""Sample index -> (offset of the first new token in that sample's output, the new tokens)."""


class ProgressWatch:
    """The progress messages of one op, queued on the event loop that reads them. Any thread may
    deliver; only that loop reads. A cancelled `next` leaves its message queued, or (when the
    message had already woken it) returns it all the same."""

    def __init__(self, op_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.op_id = op_id
        self._loop = loop
        self._messages: collections.deque[Progress] = collections.deque()
        self._arrived = asyncio.Event()

    def deliver(self, progress: Progress) -> None:
        if self._loop.is_closed():
            return
        # The loop may close between the check and the call; the message is then moot.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._append, progress)

    def _append(self, progress: Progress) -> None:
        self._messages.append(progress)
        self._arrived.set()

    async def next(self, timeout: float) -> Progress | None:
        """The next message, or None when none arrives within `timeout` seconds."""
        if not self._messages:
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), timeout)
        return self._messages.popleft() if self._messages else None


class Notifier(Protocol):
    def publish(self, op_id: str) -> None: ...

    def subscribe(self, op_id: str) -> asyncio.Event:
        """An event set when `op_id` is published; call from the event loop that awaits it."""
        ...

    def unsubscribe(self, op_id: str, event: asyncio.Event) -> None: ...

    def publish_progress(self, op_id: str, progress: Progress) -> None:
        """Tokens a running op has newly chosen, for its watchers; never raises."""
        ...

    def watch_progress(self, op_id: str) -> ProgressWatch:
        """Start receiving `op_id`'s progress; call from the event loop that reads it, before
        the op is submitted, so that no early message is missed."""
        ...

    def unwatch_progress(self, watch: ProgressWatch) -> None: ...


class InProcessNotifier:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = (
            collections.defaultdict(set)
        )
        self._watches: dict[str, set[ProgressWatch]] = collections.defaultdict(set)

    def subscribe(self, op_id: str) -> asyncio.Event:
        event = asyncio.Event()
        with self._lock:
            self._waiters[op_id].add((asyncio.get_running_loop(), event))
        return event

    def unsubscribe(self, op_id: str, event: asyncio.Event) -> None:
        with self._lock:
            waiters = self._waiters.get(op_id)
            if waiters is None:
                return
            for entry in [w for w in waiters if w[1] is event]:
                waiters.discard(entry)
            if not waiters:
                del self._waiters[op_id]

    def publish(self, op_id: str) -> None:
        with self._lock:
            waiters = list(self._waiters.get(op_id, ()))
        for loop, event in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)

    def watch_progress(self, op_id: str) -> ProgressWatch:
        watch = ProgressWatch(op_id, asyncio.get_running_loop())
        with self._lock:
            self._watches[op_id].add(watch)
        return watch

    def unwatch_progress(self, watch: ProgressWatch) -> None:
        with self._lock:
            watches = self._watches.get(watch.op_id)
            if watches is None:
                return
            watches.discard(watch)
            if not watches:
                del self._watches[watch.op_id]

    def publish_progress(self, op_id: str, progress: Progress) -> None:
        with self._lock:
            watches = list(self._watches.get(op_id, ()))
        for watch in watches:
            watch.deliver(progress)


class RedisNotifier:
    """Distributed mode: completions and progress are published on two Redis channels; each API
    process runs one listener thread that wakes its local waiters and feeds its local watches.
    Publishing never raises: a lost notification only delays a waiter until its next re-read of
    the database, and lost progress only delays streamed text until the result is recorded."""

    CHANNEL = "treadle:operations:finished"
    PROGRESS_CHANNEL = "treadle:operations:progress"
    # After a failed publish, progress (sent about every 0.1 s by a sampling worker) is dropped
    # for this long rather than stalling the worker on a connect timeout each time.
    PROGRESS_BACKOFF_S = 5.0

    def __init__(self, redis_url: str) -> None:
        import redis

        self._redis = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)
        self._local = InProcessNotifier()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._publishing = Outage(
            log,
            "publishing on Redis",
            "waiters see results on their next poll and streams get their text when results "
            "are recorded",
        )
        self._listening = Outage(
            log,
            "listening on Redis",
            "waiters here see results on their next poll (reconnecting every second)",
        )
        self._progress_resumes_at = 0.0

    def publish(self, op_id: str) -> None:
        self._publish(self.CHANNEL, op_id.encode())

    def publish_progress(self, op_id: str, progress: Progress) -> None:
        if time.monotonic() < self._progress_resumes_at:
            return
        message = {"op": op_id, "p": {str(i): [o, t] for i, (o, t) in progress.items()}}
        if not self._publish(self.PROGRESS_CHANNEL, json.dumps(message, separators=(",", ":"))):
            self._progress_resumes_at = time.monotonic() + self.PROGRESS_BACKOFF_S

    def _publish(self, channel: str, message: bytes | str) -> bool:
        """Whether Redis took the message; logs an outage once, not once per message."""
        try:
            self._redis.publish(channel, message)
        except Exception as exc:
            self._publishing.failed(exc)
            return False
        self._publishing.succeeded()
        return True

    def subscribe(self, op_id: str) -> asyncio.Event:
        return self._local.subscribe(op_id)

    def unsubscribe(self, op_id: str, event: asyncio.Event) -> None:
        self._local.unsubscribe(op_id, event)

    def watch_progress(self, op_id: str) -> ProgressWatch:
        return self._local.watch_progress(op_id)

    def unwatch_progress(self, watch: ProgressWatch) -> None:
        self._local.unwatch_progress(watch)

    def start_listening(self) -> None:
        self._thread = threading.Thread(target=self._listen, name="treadle-notify", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.CHANNEL, self.PROGRESS_CHANNEL)
                self._listening.succeeded()
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        self._dispatch(message["channel"].decode(), message["data"])
                pubsub.close()
            except Exception as exc:
                self._listening.failed(exc)
                self._stop.wait(1.0)

    def _dispatch(self, channel: str, data: bytes) -> None:
        if channel == self.CHANNEL:
            self._local.publish(data.decode())
            return
        try:
            op_id, progress = _parse_progress(json.loads(data))
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            log.warning("ignoring a malformed progress message: %r", data[:200])
            return
        self._local.publish_progress(op_id, progress)


def _parse_progress(message: Any) -> tuple[str, Progress]:
    progress: Progress = {
        int(index): (int(entry[0]), [int(token) for token in entry[1]])
        for index, entry in message["p"].items()
    }
    return str(message["op"]), progress
