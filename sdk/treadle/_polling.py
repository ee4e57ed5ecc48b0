"""Submitting operations and long-polling their results (`/retrieve_future`).

A submission answers `{"request_id": ...}` at once; the result is then fetched by polling,
which the server holds open for about 25 s per call. The server answers one of: the result
(protobuf for forward_backward and sample results, JSON otherwise), `try_again` (still
queued or running), or `{"error", "category", "code"}` (the operation failed).

A successful result carries the operation's billed quantities and their cost (`cost_micros`)
in the `X-Treadle-Usage` header; `retrieve` adds them to the `UsageTally` of the SDK call it
runs under (see `tallied`), so a call made of several requests reports their sum.
"""

from __future__ import annotations

import contextvars
import json
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

import httpx

from treadle._http import HttpClient
from treadle._loop import BackgroundLoop
from treadle.errors import APIStatusError, FutureExpiredError, error_from_failed_request
from treadle.futures import APIFuture
from treadle.types import UntypedAPIFuture
from treadle.wire import PROTOBUF_CONTENT_TYPE

logger = logging.getLogger("treadle")

T = TypeVar("T")

RETRIEVE_TIMEOUT_SECONDS = 45.0
"""Longer than the server's long-poll window (about 25 s)."""
_PAUSED_LOG_INTERVAL_SECONDS = 60.0

USAGE_HEADER = "x-treadle-usage"


class UsageTally:
    """The billed quantities (kind -> quantity) and cost (`cost_micros`) of the requests of one
    SDK call, summed.

    `quantities` stays None until a result with a usage header arrives.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._quantities: dict[str, int] | None = None

    def add(self, usage: Mapping[str, int]) -> None:
        with self._lock:
            total = dict(self._quantities or {})
            for kind, quantity in usage.items():
                total[kind] = total.get(kind, 0) + quantity
            self._quantities = total

    @property
    def quantities(self) -> dict[str, int] | None:
        """A copy of the sums so far (None when no request reported usage)."""
        with self._lock:
            return None if self._quantities is None else dict(self._quantities)


_current_tally: contextvars.ContextVar[UsageTally | None] = contextvars.ContextVar(
    "treadle_usage_tally", default=None
)


async def tallied(coro: Coroutine[Any, Any, T], tally: UsageTally) -> T:
    """Run `coro` with `tally` collecting the usage of every result it retrieves.

    Run as its own task (the context variable it sets stays in that task and the tasks it
    starts, e.g. `asyncio.gather` over chunks).
    """
    _current_tally.set(tally)
    return await coro


def spawn_tallied(loop: BackgroundLoop, coro: Coroutine[Any, Any, T]) -> APIFuture[T]:
    """Run `coro` on `loop` as one SDK call: its future's `usage` sums its requests' usage.

    Raises:
        ClientClosedError: the client is closed.
    """
    tally = UsageTally()
    wrapped = tallied(coro, tally)
    try:
        future = loop.spawn(wrapped)
    except BaseException:
        coro.close()
        raise
    return APIFuture(future, lambda: tally.quantities)


def _record_usage(response: httpx.Response) -> None:
    tally = _current_tally.get()
    raw = response.headers.get(USAGE_HEADER)
    if tally is None or raw is None:
        return
    try:
        usage = json.loads(raw)
    except ValueError:
        logger.debug("ignoring a malformed usage header: %r", raw)
        return
    if not isinstance(usage, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
        for k, v in usage.items()
    ):
        logger.debug("ignoring a malformed usage header: %r", raw)
        return
    tally.add(usage)


async def submit(
    http: HttpClient,
    path: str,
    *,
    json: Any = None,
    content: bytes | None = None,
    headers: Mapping[str, str] | None = None,
) -> UntypedAPIFuture:
    """POST an operation and return its future handle.

    Raises:
        APIStatusError: the server refused the submission (its message says why).
        APIConnectionError: the server stayed unreachable for the whole retry budget.
    """
    response = await http.request("POST", path, json=json, content=content, headers=headers)
    return UntypedAPIFuture.model_validate(response.json())


async def retrieve(
    http: HttpClient,
    request_id: str,
    decode: Callable[[httpx.Response], T],
    *,
    request_type: str,
    protobuf: bool = False,
) -> T:
    """Poll until the operation finishes, then decode its result.

    Args:
        decode: turns the final response into the result type.
        request_type: a label sent as `X-Tinker-Request-Type` (e.g. `ForwardBackward`).
        protobuf: ask for a protobuf result (forward_backward and sample results).

    Raises:
        RequestFailedError: the operation failed; `category` says whose fault.
        FutureExpiredError: the server no longer holds this result.
        APIStatusError, APIConnectionError: as for any request, once retries ran out.
    """
    iteration = 0
    last_paused_log = 0.0
    while True:
        headers = {
            "X-Tinker-Request-Type": request_type,
            "X-Tinker-Request-Iteration": str(iteration),
        }
        if protobuf:
            headers["Accept"] = f"{PROTOBUF_CONTENT_TYPE}, application/json"
        try:
            response = await http.request(
                "POST",
                "/api/v1/retrieve_future",
                json={"request_id": request_id, "allow_metadata_only": False},
                headers=headers,
                timeout=RETRIEVE_TIMEOUT_SECONDS,
            )
        except APIStatusError as exc:
            if exc.status_code == 410:
                raise FutureExpiredError(
                    f"the result of request {request_id} has expired on the server; "
                    "submit the operation again"
                ) from exc
            raise
        iteration += 1
        if PROTOBUF_CONTENT_TYPE in response.headers.get("content-type", ""):
            result = decode(response)
            _record_usage(response)
            return result
        body = response.json()
        if isinstance(body, dict):
            if "error" in body:
                code = body.get("code")
                raise error_from_failed_request(
                    str(body["error"]),
                    str(body.get("category") or "unknown"),
                    request_id,
                    code if isinstance(code, str) else None,
                )
            if body.get("type") == "try_again":
                state = body.get("queue_state", "active")
                now = time.monotonic()
                if state != "active" and now - last_paused_log > _PAUSED_LOG_INTERVAL_SECONDS:
                    last_paused_log = now
                    logger.warning(
                        "request %s is paused (%s): %s",
                        request_id,
                        state,
                        body.get("queue_state_reason") or "waiting for capacity",
                    )
                continue
            if body.get("status") == "complete_metadata":
                continue
        result = decode(response)
        _record_usage(response)
        return result
