"""HTTP transport: one `httpx.AsyncClient`, the API key, and retries for transient failures.

Only failures that cannot be the caller's fault are retried: connection errors, timeouts, and
the statuses 408, 409, 429 and 5xx (unless the server says `x-should-retry: false`). Every
other status raises at once with the server's message (see `treadle.errors`). Retrying a
submission is safe because the body carries the same `seq_id`, on which the server dedupes.

This module knows nothing of sessions, futures or the shape of any body.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import logging
import random
import time
from collections.abc import Mapping
from typing import Any

import httpx

from treadle import __version__
from treadle.errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    error_from_response,
)

logger = logging.getLogger("treadle")

DEFAULT_TIMEOUT_SECONDS = 60.0
_RETRY_STATUSES = frozenset({408, 409, 429})
_MAX_RETRY_AFTER_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How long, and how often, transient failures are retried.

    Attributes:
        max_elapsed_seconds: give up once this much time has passed since the first attempt
            (the last error is then raised).
        max_attempts: give up after this many attempts (None: only the elapsed-time bound).
        initial_backoff_seconds: the first wait; each later one doubles.
        max_backoff_seconds: the longest wait between attempts.
    """

    max_elapsed_seconds: float = 300.0
    max_attempts: int | None = None
    initial_backoff_seconds: float = 0.5
    max_backoff_seconds: float = 10.0

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry number `attempt` (0-based), with jitter."""
        base = min(self.max_backoff_seconds, self.initial_backoff_seconds * (2**attempt))
        return base * random.uniform(0.75, 1.0)

    def allows(self, attempt: int, started: float, wait: float) -> bool:
        if self.max_attempts is not None and attempt + 1 >= self.max_attempts:
            return False
        return time.monotonic() + wait - started <= self.max_elapsed_seconds


NO_RETRY = RetryPolicy(max_attempts=1)


def is_retryable_status(response: httpx.Response) -> bool:
    should = response.headers.get("x-should-retry")
    if should == "false":
        return False
    if should == "true":
        return True
    return response.status_code in _RETRY_STATUSES or response.status_code >= 500


def retry_after_seconds(response: httpx.Response) -> float | None:
    """The server's requested wait (`retry-after-ms` or `retry-after`), when sensible."""
    raw_ms = response.headers.get("retry-after-ms")
    if raw_ms is not None:
        try:
            return _bounded(float(raw_ms) / 1000.0)
        except ValueError:
            pass
    raw = response.headers.get("retry-after")
    if raw is None:
        return None
    try:
        return _bounded(float(raw))
    except ValueError:
        parsed = email.utils.parsedate_to_datetime(raw) if raw else None
        if parsed is None:
            return None
        return _bounded(parsed.timestamp() - time.time())


def _bounded(seconds: float) -> float | None:
    return seconds if 0 <= seconds <= _MAX_RETRY_AFTER_SECONDS else None


class HttpClient:
    """Sends requests to one Treadle server with the caller's API key.

    Args:
        base_url: the server, e.g. `http://127.0.0.1:8000` (a path prefix is kept).
        api_key: sent as `X-API-Key` on every request.
        retry: the default retry policy for transient failures.
        timeout: default read timeout in seconds.
        transport: an httpx transport to use instead of the network (tests, proxies).
        headers: extra headers sent on every request.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        retry: RetryPolicy | None = None,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        transport: httpx.AsyncBaseTransport | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers={
                "X-API-Key": api_key,
                "User-Agent": f"treadle-python/{__version__}",
                "Accept-Encoding": "gzip, deflate",
                **(headers or {}),
            },
            timeout=httpx.Timeout(timeout, connect=10.0),
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100),
            transport=transport,
        )

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        idempotent: bool = True,
    ) -> httpx.Response:
        """Send one request, retrying transient failures; returns a 2xx response.

        Args:
            idempotent: False for requests that must not be repeated once the server may have
                seen them (e.g. create_session): they are retried only when they certainly
                did not arrive (connection refused) or the server answered with an error.

        Raises:
            APIStatusError: (a subclass of) for an HTTP error, at once when permanent.
            APIConnectionError: the server stayed unreachable for the whole retry budget.
        """
        policy = retry or self.retry
        started = time.monotonic()
        attempt = 0
        extra: dict[str, Any] = {}
        if timeout is not None:
            extra["timeout"] = httpx.Timeout(timeout, connect=10.0)
        while True:
            try:
                response = await self._client.request(
                    method,
                    path,
                    json=json,
                    content=content,
                    headers=headers,
                    params=params,
                    **extra,
                )
            except httpx.TransportError as exc:
                error = _connection_error(exc)
                may_retry = idempotent or isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
                wait = policy.backoff(attempt)
                if not may_retry or not policy.allows(attempt, started, wait):
                    raise error from exc
                logger.info("%s %s failed (%s); retrying in %.1fs", method, path, exc, wait)
            else:
                if response.is_success:
                    return response
                status_error = error_from_response(response)
                wait = retry_after_seconds(response) or policy.backoff(attempt)
                if not is_retryable_status(response) or not policy.allows(attempt, started, wait):
                    raise status_error
                logger.info(
                    "%s %s answered %d; retrying in %.1fs",
                    method,
                    path,
                    response.status_code,
                    wait,
                )
            await asyncio.sleep(wait)
            attempt += 1

    async def aclose(self) -> None:
        await self._client.aclose()


def _connection_error(exc: httpx.TransportError) -> APIConnectionError:
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError(f"the server did not answer in time: {exc!r}")
    return APIConnectionError(f"could not reach the server: {exc!r}")


__all__ = [
    "DEFAULT_TIMEOUT_SECONDS",
    "NO_RETRY",
    "APIStatusError",
    "HttpClient",
    "RetryPolicy",
    "is_retryable_status",
    "retry_after_seconds",
]
