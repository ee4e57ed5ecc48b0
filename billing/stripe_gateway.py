"""The payment gateway: the only module that speaks to Stripe (an import-linter contract).

It sends Billing meter events and reads meters and meter event summaries through the official
`stripe` library, and owns the retry policy: Stripe's 429s, 5xx answers and lost connections are
retried with exponential backoff and full jitter, a bounded number of times. The library's own
retries are off, since it does not retry 429.

It knows nothing of tenants, the ledger or what was pushed before; `billing.stripe_push` and
`billing.stripe_reconcile` decide what to send and what to compare.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import stripe

from core.errors import ErrorCode, TreadleError

log = logging.getLogger(__name__)

STRIPE_API_BASE = "https://api.stripe.com"
# Stripe's limits on a meter event: its identifier's length, and how old its timestamp may be.
MAX_IDENTIFIER_LENGTH = 100
MAX_EVENT_AGE_DAYS = 35
# Stripe answers a second event with a known identifier with a 400 whose message says so.
DUPLICATE_IDENTIFIER_MESSAGE = "An event already exists with identifier"

T = TypeVar("T")


class StripeUnavailable(TreadleError):
    """Stripe did not accept a request: `refused` when it said no for good (a bad request, a
    key without access), else it stayed unreachable or overloaded through every retry."""

    category = "server"
    code = ErrorCode.INTERNAL_ERROR

    def __init__(
        self, message: str, *, refused: bool = False, code: ErrorCode | None = None
    ) -> None:
        super().__init__(message, code=code)
        self.refused = refused


@dataclass(frozen=True)
class MeterEvent:
    """One meter event: `value` of the meter named `event_name` for one Stripe customer."""

    event_name: str
    stripe_customer_id: str
    value: int
    identifier: str
    timestamp: datetime


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts per request, and the backoff between them: the n-th wait is uniform in
    [0, min(max_delay, base_delay * 2**n)] (full jitter), or Stripe's Retry-After when longer."""

    attempts: int = 6
    base_delay: float = 0.5
    max_delay: float = 20.0


def _retryable(exc: stripe.StripeError) -> bool:
    if isinstance(exc, stripe.APIConnectionError):
        return True
    status = exc.http_status or 0
    return status == 429 or status >= 500


def _is_duplicate_identifier(exc: stripe.StripeError) -> bool:
    return exc.http_status == 400 and DUPLICATE_IDENTIFIER_MESSAGE in (exc.user_message or "")


class StripeGateway:
    """Stripe Billing meters, through one `stripe.StripeClient`."""

    def __init__(
        self,
        api_key: str,
        *,
        api_base: str = STRIPE_API_BASE,
        retry: RetryPolicy | None = None,
        sleep: Callable[[float], None] = time.sleep,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self._client = stripe.StripeClient(
            api_key,
            base_addresses={"api": api_base, "meter_events": api_base},
            max_network_retries=0,
        )
        self._retry = retry or RetryPolicy()
        self._sleep = sleep
        self._jitter = jitter

    def send_meter_event(self, event: MeterEvent) -> bool:
        """Send one meter event. True when Stripe recorded it now, False when it already held
        an event with this identifier (a repeat: the event counts as accepted either way)."""
        if len(event.identifier) > MAX_IDENTIFIER_LENGTH:
            raise ValueError(
                f"meter event identifier {event.identifier!r} is longer than Stripe's "
                f"{MAX_IDENTIFIER_LENGTH} characters; shorten the tenant id or the event name"
            )
        params: Any = {
            "event_name": event.event_name,
            "payload": {
                "stripe_customer_id": event.stripe_customer_id,
                "value": str(event.value),
            },
            "identifier": event.identifier,
            "timestamp": int(event.timestamp.timestamp()),
        }
        try:
            self._call(
                f"meter event {event.identifier}",
                self._client.v1.billing.meter_events.create,
                params,
            )
        except StripeUnavailable as exc:
            cause = exc.__cause__
            if isinstance(cause, stripe.StripeError) and _is_duplicate_identifier(cause):
                return False
            raise
        return True

    def meter_ids(self) -> dict[str, str]:
        """Stripe's active meters: event name → meter id."""
        found: dict[str, str] = {}
        params: dict[str, Any] = {"limit": 100, "status": "active"}
        while True:
            page = self._call("meter list", self._client.v1.billing.meters.list, dict(params))
            for meter in page.data:
                found[meter.event_name] = meter.id
            if not page.has_more or not page.data:
                return found
            params["starting_after"] = page.data[-1].id

    def summed_value(
        self, meter_id: str, stripe_customer_id: str, start: datetime, end: datetime
    ) -> int:
        """What Stripe holds for one customer on one meter over [start, end): the sum of the
        meter's event summaries (`start` and `end` on whole minutes)."""
        total = 0.0
        params: dict[str, Any] = {
            "customer": stripe_customer_id,
            "start_time": int(start.timestamp()),
            "end_time": int(end.timestamp()),
            "limit": 100,
        }
        while True:
            page = self._call(
                f"event summaries of meter {meter_id}",
                self._client.v1.billing.meters.event_summaries.list,
                meter_id,
                dict(params),
            )
            total += sum(summary.aggregated_value for summary in page.data)
            if not page.has_more or not page.data:
                return round(total)
            params["starting_after"] = page.data[-1].id

    def _call(self, what: str, request: Callable[..., T], *args: Any) -> T:
        attempt = 0
        while True:
            try:
                return request(*args)
            except stripe.StripeError as exc:
                attempt += 1
                if not _retryable(exc) or attempt >= self._retry.attempts:
                    raise StripeUnavailable(
                        self._failure(what, exc, attempt), refused=not _retryable(exc)
                    ) from exc
                delay = self._delay(attempt, exc)
                log.info(
                    "Stripe answered %s to %s (attempt %d); retrying in %.2f s",
                    exc.http_status or type(exc).__name__,
                    what,
                    attempt,
                    delay,
                )
                self._sleep(delay)

    def _delay(self, attempt: int, exc: stripe.StripeError) -> float:
        ceiling = min(self._retry.max_delay, self._retry.base_delay * 2 ** (attempt - 1))
        delay = ceiling * self._jitter()
        retry_after = (exc.headers or {}).get("retry-after") or (exc.headers or {}).get(
            "Retry-After"
        )
        if retry_after is not None:
            with contextlib.suppress(ValueError):
                delay = max(delay, min(float(retry_after), self._retry.max_delay))
        return delay

    @staticmethod
    def _failure(what: str, exc: stripe.StripeError, attempts: int) -> str:
        status = exc.http_status or type(exc).__name__
        reason = exc.user_message or str(exc)
        if isinstance(exc, stripe.AuthenticationError):
            return (
                f"Stripe refused the API key for {what} ({reason}); set TREADLE_STRIPE_API_KEY "
                "to a secret or restricted key with Billing meter access"
            )
        if _retryable(exc):
            return (
                f"Stripe did not accept {what} after {attempts} attempts (last answer: {status}: "
                f"{reason}); the next push retries it"
            )
        return f"Stripe refused {what} ({status}: {reason})"
