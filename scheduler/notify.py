"""Wake-ups for long-polls: "operation X finished" from where it ran to whoever waits on it.

The database is the truth; a notification only says "look again". Losing one costs a waiter
at most one poll interval. In-process here; distributed mode publishes through Redis.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import defaultdict
from typing import Protocol

log = logging.getLogger(__name__)


class Notifier(Protocol):
    def publish(self, op_id: str) -> None: ...

    def subscribe(self, op_id: str) -> asyncio.Event:
        """An event set when `op_id` is published; call from the event loop that awaits it."""
        ...

    def unsubscribe(self, op_id: str, event: asyncio.Event) -> None: ...


class InProcessNotifier:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = (
            defaultdict(set)
        )

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


class RedisNotifier:
    """Distributed mode: completions are published on one Redis channel; each API process runs
    one listener thread that wakes its local waiters. Publishing never raises: a lost
    notification only delays a waiter until its next re-read of the database."""

    CHANNEL = "treadle:operations:finished"

    def __init__(self, redis_url: str) -> None:
        import redis

        self._redis = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)
        self._local = InProcessNotifier()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def publish(self, op_id: str) -> None:
        try:
            self._redis.publish(self.CHANNEL, op_id)
        except Exception:
            log.warning(
                "could not publish completion of %s; waiters will see it on their next poll", op_id
            )

    def subscribe(self, op_id: str) -> asyncio.Event:
        return self._local.subscribe(op_id)

    def unsubscribe(self, op_id: str, event: asyncio.Event) -> None:
        self._local.unsubscribe(op_id, event)

    def start_listening(self) -> None:
        self._thread = threading.Thread(target=self._listen, name="treadle-notify", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.CHANNEL)
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        self._local.publish(message["data"].decode())
                pubsub.close()
            except Exception:
                log.warning("lost the Redis notification channel; reconnecting", exc_info=True)
                self._stop.wait(1.0)
