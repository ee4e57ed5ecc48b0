"""HTTP transport: one `httpx.AsyncClient`, the API key, and retries for transient failures.

Only failures that cannot be the caller's fault are retried: connection errors, timeouts, and
the statuses 408, 409, 429 and 5xx (unless the server says `x-should-retry: false`). Every
other status raises at once with the server's message (see `treadle.errors`). Retrying a
submission is safe because the body carries the same `seq_id`, on which the server dedupes.

Until the server has answered once, the retries are bounded by a short first-contact deadline
(`first_contact_seconds`, default `TREADLE_CONNECT_TIMEOUT` or 10 s), so a wrong or dead URL
fails in seconds with an error naming the URL and where it came from; after that, transient
failures get the patient policy (a server restart during a long run is waited out).

This module knows nothing of sessions, futures or the shape of any body.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import logging
import os
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
    InvalidArgumentError,
    error_from_response,
)

logger = logging.getLogger("treadle")

DEFAULT_TIMEOUT_SECONDS = 60.0
DEFAULT_FIRST_CONTACT_SECONDS = 10.0
CONNECT_TIMEOUT_ENV = "TREADLE_CONNECT_TIMEOUT"
_CONNECT_SECONDS = 10.0
_QUIET_RETRIES = 3
"""Retries after this many are logged at WARNING (the first ones at INFO)."""
_GATEWAY_STATUSES = frozenset({502, 503, 504})
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


def first_contact_seconds(value: float | None = None) -> float:
    """The first-contact deadline: `value`, else `$TREADLE_CONNECT_TIMEOUT`, else 10 s.

    Raises:
        InvalidArgumentError: the value (or the variable) is not a positive number of seconds.
    """
    if value is None:
        raw = os.environ.get(CONNECT_TIMEOUT_ENV)
        if raw is None or not raw.strip():
            return DEFAULT_FIRST_CONTACT_SECONDS
        try:
            value = float(raw)
        except ValueError:
            raise InvalidArgumentError(
                f"{CONNECT_TIMEOUT_ENV}={raw!r} is not a number; set it to the seconds to wait "
                "for the server's first answer, e.g. 10"
            ) from None
    if not value > 0:
        raise InvalidArgumentError(
            f"connect_timeout must be a positive number of seconds, got {value!r}"
        )
    return value


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
        first_contact_seconds: until the server first answers, give up after this long.
        url_source: where `base_url` came from (`base_url=`, `TREADLE_BASE_URL`, ...), named
            in the error when the server cannot be reached.
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
        first_contact_seconds: float = DEFAULT_FIRST_CONTACT_SECONDS,
        url_source: str = "base_url=",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self.first_contact_seconds = first_contact_seconds
        self.url_source = url_source
        self.contacted = False
        """Whether the server has answered yet; until then retries stop at the first-contact
        deadline."""
        self._read_timeout = timeout
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers={
                "X-API-Key": api_key,
                "User-Agent": f"treadle-python/{__version__}",
                "Accept-Encoding": "gzip, deflate",
                **(headers or {}),
            },
            timeout=httpx.Timeout(timeout, connect=_CONNECT_SECONDS),
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
        while True:
            first_contact = not self.contacted
            deadline = policy.max_elapsed_seconds
            if first_contact:
                deadline = min(deadline, self.first_contact_seconds)
                policy = dataclasses.replace(policy, max_elapsed_seconds=deadline)
            connect = _CONNECT_SECONDS
            if first_contact:
                connect = max(0.1, min(connect, started + deadline - time.monotonic()))
            try:
                response = await self._client.request(
                    method,
                    path,
                    json=json,
                    content=content,
                    headers=headers,
                    params=params,
                    timeout=httpx.Timeout(
                        self._read_timeout if timeout is None else timeout, connect=connect
                    ),
                )
            except httpx.TransportError as exc:
                error = self._connection_error(exc, first_contact, time.monotonic() - started)
                may_retry = idempotent or isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
                wait = policy.backoff(attempt)
                if first_contact and may_retry and not policy.allows(attempt, started, wait):
                    wait = _last_wait(policy, attempt, started)  # one last try at the deadline
                if not may_retry or not policy.allows(attempt, started, wait):
                    raise error from exc
                self._log_retry(attempt, "%s %s failed (%s)", method, path, exc, wait=wait)
            else:
                if response.status_code not in _GATEWAY_STATUSES:
                    self.contacted = True
                if response.is_success:
                    return response
                status_error = error_from_response(response)
                wait = retry_after_seconds(response) or policy.backoff(attempt)
                if not is_retryable_status(response) or not policy.allows(attempt, started, wait):
                    raise status_error
                self._log_retry(
                    attempt, "%s %s answered %d", method, path, response.status_code, wait=wait
                )
            await asyncio.sleep(wait)
            attempt += 1

    def _log_retry(self, attempt: int, message: str, *args: object, wait: float) -> None:
        level = logging.INFO if attempt < _QUIET_RETRIES else logging.WARNING
        where = "" if self.contacted else f" (server {self.base_url}, not reached yet)"
        logger.log(level, message + "%s; retry %d in %.1fs", *args, where, attempt + 1, wait)

    def _connection_error(
        self, exc: httpx.TransportError, first_contact: bool, elapsed: float
    ) -> APIConnectionError:
        if not first_contact:
            return _connection_error(exc)
        cls = APITimeoutError if isinstance(exc, httpx.TimeoutException) else APIConnectionError
        return cls(
            f"could not reach the Treadle server at {self.base_url} (set by {self.url_source}) "
            f"within {elapsed:.0f}s: {exc!r}; check that the server is running and that the URL "
            f"is right, or set {CONNECT_TIMEOUT_ENV} (connect_timeout=) to wait longer"
        )

    async def aclose(self) -> None:
        await self._client.aclose()


def _last_wait(policy: RetryPolicy, attempt: int, started: float) -> float:
    """A wait that puts one more attempt just before the deadline, when there is time for one
    (otherwise the elapsed-time bound would end the first contact a whole backoff early)."""
    remaining = started + policy.max_elapsed_seconds - time.monotonic()
    return remaining - 0.25 if remaining > 0.5 else policy.backoff(attempt)


def _connection_error(exc: httpx.TransportError) -> APIConnectionError:
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError(f"the server did not answer in time: {exc!r}")
    return APIConnectionError(f"could not reach the server: {exc!r}")


__all__ = [
    "CONNECT_TIMEOUT_ENV",
    "DEFAULT_FIRST_CONTACT_SECONDS",
    "DEFAULT_TIMEOUT_SECONDS",
    "NO_RETRY",
    "APIStatusError",
    "HttpClient",
    "RetryPolicy",
    "first_contact_seconds",
    "is_retryable_status",
    "retry_after_seconds",
]
