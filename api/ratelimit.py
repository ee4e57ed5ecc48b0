"""In-process token buckets, for cheap endpoints that must not be flooded (telemetry)."""

from __future__ import annotations

import threading
import time

from core.errors import RateLimited


class TokenBuckets:
    def __init__(self, per_minute: int, burst: int | None = None) -> None:
        self.rate = per_minute / 60.0
        self.capacity = float(burst if burst is not None else max(1, per_minute // 4))
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def take(self, key: str, what: str) -> None:
        now = time.monotonic()
        with self._lock:
            tokens, last = self._buckets.get(key, (self.capacity, now))
            tokens = min(self.capacity, tokens + (now - last) * self.rate)
            if tokens < 1.0:
                self._buckets[key] = (tokens, now)
                raise RateLimited(
                    f"too many {what} requests; slow down to {int(self.rate * 60)} per minute",
                    retry_after_seconds=(1.0 - tokens) / self.rate,
                )
            self._buckets[key] = (tokens - 1.0, now)
