"""Seq ids of one training run, and the rule that submissions are POSTed in their order.

Ids are reserved at call time on the caller's thread, so the order of calls is the order of
execution on the server. The POSTs then take turns on the background loop: a submission waits
until every earlier reserved id has been sent (or has definitely failed), while waiting for
results is never serialised.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator


class Sequencer:
    """Hands out consecutive seq ids and serialises the POSTs that carry them."""

    def __init__(self, first_seq_id: int = 1) -> None:
        self._lock = threading.Lock()
        self._next = first_seq_id
        self._turn = first_seq_id
        self._changed: asyncio.Condition | None = None  # made on the loop that uses it

    def reserve(self, count: int = 1) -> int:
        """Reserve `count` consecutive ids; returns the first."""
        with self._lock:
            first = self._next
            self._next += count
            return first

    @contextlib.asynccontextmanager
    async def turn(self, first: int, count: int = 1) -> AsyncIterator[None]:
        """Wait until ids before `first` are sent; on exit pass the turn on to `first + count`.

        The turn passes on even when the body raises: a submission that failed for good
        leaves a gap the server skips after a while, rather than blocking this client.
        """
        if self._changed is None:
            self._changed = asyncio.Condition()
        changed = self._changed
        async with changed:
            await changed.wait_for(lambda: self._turn >= first)
        try:
            yield
        finally:
            async with changed:
                self._turn = max(self._turn, first + count)
                changed.notify_all()
