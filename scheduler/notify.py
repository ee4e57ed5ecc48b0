"""Wake-ups for long-polls: "operation X finished" from where it ran to whoever waits on it.

The database is the truth; a notification only says "look again". Losing one costs a waiter
at most one poll interval. In-process here; distributed mode publishes through Redis.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from typing import Protocol


class Notifier(Protocol):
    def publish(self, op_id: str) -> None: ...

    def subscribe(self, op_id: str) -> asyncio.Event:
        """An event set when `op_id` is published; call from the event loop that awaits it."""
        ...

    def unsubscribe(self, op_id: str, event: asyncio.Event) -> None: ...


class InProcessNotifier:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = defaultdict(set)

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
