"""A fake Stripe for tests: a real HTTP server on loopback that answers the Billing meter
endpoints the gateway calls, form-encoded in and JSON out as Stripe does.

It keeps meters and meter events, refuses a second event with a known identifier the way Stripe
does (400, "An event already exists with identifier ...", `Stripe-Should-Retry: false`), checks
the 35-day age limit against its own clock, and sums events into meter event summaries. Faults
are queued: the next N requests answer 500 or 429, or the next N meter events are stored and
then the connection is dropped before any answer.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

API_KEY = "sk_test_treadle_fake"
MAX_AGE = timedelta(days=35)
MAX_AHEAD = timedelta(minutes=5)


@dataclass(frozen=True)
class StoredEvent:
    event_name: str
    customer: str
    value: int
    identifier: str
    timestamp: int


class FakeStripe:
    """State and fault plan of the fake; `url` is what to give the gateway as its API base."""

    def __init__(self, now: Callable[[], datetime] | None = None) -> None:
        self.now = now or (lambda: datetime.now(UTC))
        self.meters: dict[str, str] = {}  # meter id → event name
        self.events: list[StoredEvent] = []
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request
        self._ids = itertools.count(1)
        self._faults: deque[str] = deque()  # an HTTP status to answer, or "drop"
        self._lock = threading.Lock()
        self.url = ""

    # Set-up and inspection, for tests.

    def add_meter(self, event_name: str) -> str:
        meter_id = f"mtr_test_{next(self._ids):06d}"
        with self._lock:
            self.meters[meter_id] = event_name
        return meter_id

    def add_event(self, event_name: str, customer: str, value: int, timestamp: datetime) -> None:
        """Store an event as if someone else had sent it (a discrepancy to find)."""
        with self._lock:
            self.events.append(
                StoredEvent(
                    event_name,
                    customer,
                    value,
                    f"injected-{next(self._ids)}",
                    int(timestamp.timestamp()),
                )
            )

    def fail_next(self, count: int, status: int = 500) -> None:
        """Answer the next `count` requests with `status` (500, 503, 429…) and no effect."""
        with self._lock:
            self._faults.extend([str(status)] * count)

    def drop_next(self, count: int) -> None:
        """Store the next `count` meter events, then drop each connection unanswered."""
        with self._lock:
            self._faults.extend(["drop"] * count)

    def total(self, event_name: str, customer: str) -> int:
        with self._lock:
            return sum(
                e.value
                for e in self.events
                if e.event_name == event_name and e.customer == customer
            )

    def identifiers(self) -> list[str]:
        with self._lock:
            return [e.identifier for e in self.events]

    # The endpoints.

    def handle(
        self, method: str, path: str, query: dict[str, str], form: dict[str, str]
    ) -> tuple[int, dict[str, Any], str | None]:
        """(status, body, fault): fault "drop" when the connection is to be dropped."""
        with self._lock:
            self.requests.append((method, path))
            fault = self._faults.popleft() if self._faults else None
        if fault is not None and fault.isdigit():
            rate_limited = fault == "429"
            status, body = _error(
                int(fault),
                "invalid_request_error" if rate_limited else "api_error",
                "Too many requests hit the API too quickly." if rate_limited else "injected fault",
                code="rate_limit" if rate_limited else None,
            )
            return status, body, None
        if method == "POST" and path == "/v1/billing/meter_events":
            status, body = self._create_event(form)
            return status, body, fault
        if fault == "drop":
            return 0, {}, fault
        if method == "GET" and path == "/v1/billing/meters":
            return 200, self._list_meters(query), None
        parts = path.split("/")
        if method == "GET" and len(parts) == 6 and parts[5] == "event_summaries":
            return (*self._summaries(parts[4], query), None)
        status, body = _error(
            404, "invalid_request_error", f"Unrecognized request URL ({method}: {path})"
        )
        return status, body, None

    def _create_event(self, form: dict[str, str]) -> tuple[int, dict[str, Any]]:
        event_name = form.get("event_name", "")
        customer = form.get("payload[stripe_customer_id]")
        raw_value = form.get("payload[value]")
        identifier = form.get("identifier") or f"gen-{next(self._ids)}"
        now = self.now()
        timestamp = int(form.get("timestamp", now.timestamp()))
        if customer is None or raw_value is None:
            return _error(
                400, "invalid_request_error", "payload needs stripe_customer_id and value"
            )
        when = datetime.fromtimestamp(timestamp, UTC)
        if not now - MAX_AGE <= when <= now + MAX_AHEAD:
            return _error(
                400,
                "invalid_request_error",
                "Timestamp must be within the past 35 calendar days or up to 5 minutes in the future",
                param="timestamp",
            )
        with self._lock:
            if event_name not in self.meters.values():
                return _error(
                    400,
                    "invalid_request_error",
                    f"No active meter was found matching event_name {event_name}",
                    param="event_name",
                )
            if any(e.identifier == identifier for e in self.events):
                return _error(
                    400,
                    "invalid_request_error",
                    f"An event already exists with identifier {identifier}.",
                    should_retry=False,
                )
            self.events.append(
                StoredEvent(event_name, customer, int(raw_value), identifier, timestamp)
            )
        return 200, {
            "object": "billing.meter_event",
            "created": int(now.timestamp()),
            "event_name": event_name,
            "identifier": identifier,
            "livemode": False,
            "payload": {"stripe_customer_id": customer, "value": raw_value},
            "timestamp": timestamp,
        }

    def _list_meters(self, query: dict[str, str]) -> dict[str, Any]:
        with self._lock:
            ids = sorted(self.meters)
            names = dict(self.meters)
        after = query.get("starting_after")
        if after in ids:
            ids = ids[ids.index(after) + 1 :]
        limit = int(query.get("limit", "10"))
        page = ids[:limit]
        return {
            "object": "list",
            "url": "/v1/billing/meters",
            "has_more": len(ids) > limit,
            "data": [
                {
                    "id": meter_id,
                    "object": "billing.meter",
                    "event_name": names[meter_id],
                    "display_name": names[meter_id],
                    "status": "active",
                    "customer_mapping": {
                        "type": "by_id",
                        "event_payload_key": "stripe_customer_id",
                    },
                    "default_aggregation": {"formula": "sum"},
                    "value_settings": {"event_payload_key": "value"},
                    "livemode": False,
                }
                for meter_id in page
            ],
        }

    def _summaries(self, meter_id: str, query: dict[str, str]) -> tuple[int, dict[str, Any]]:
        with self._lock:
            event_name = self.meters.get(meter_id)
            events = list(self.events)
        if event_name is None:
            return _error(404, "invalid_request_error", f"No such billing meter: '{meter_id}'")
        start, end = int(query["start_time"]), int(query["end_time"])
        if start % 60 or end % 60:
            return _error(
                400,
                "invalid_request_error",
                "start_time and end_time must be aligned with minute boundaries",
            )
        value = sum(
            e.value
            for e in events
            if e.event_name == event_name
            and e.customer == query["customer"]
            and start <= e.timestamp < end
        )
        return 200, {
            "object": "list",
            "url": f"/v1/billing/meters/{meter_id}/event_summaries",
            "has_more": False,
            "data": [
                {
                    "id": f"mtrusg_test_{meter_id}_{start}",
                    "object": "billing.meter_event_summary",
                    "aggregated_value": value,
                    "start_time": start,
                    "end_time": end,
                    "livemode": False,
                    "meter": meter_id,
                }
            ],
        }


def _error(
    status: int,
    kind: str,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    should_retry: bool | None = None,
) -> tuple[int, dict[str, Any]]:
    error: dict[str, Any] = {"type": kind, "message": message}
    if code is not None:
        error["code"] = code
    if param is not None:
        error["param"] = param
    body: dict[str, Any] = {"error": error}
    if should_retry is not None:
        body["_should_retry"] = should_retry
    return status, body


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        if self.headers.get("Authorization") != f"Bearer {API_KEY}":
            status, payload = _error(401, "invalid_request_error", "Invalid API Key provided")
            self._answer(status, payload)
            return
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        form = {k: v[-1] for k, v in parse_qs(body).items()}
        status, payload, fault = self.server.fake.handle(method, url.path, query, form)
        if fault == "drop":
            # Accepted (or not), and never answered: the client sees the connection close.
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self._answer(status, payload)

    def _answer(self, status: int, payload: dict[str, Any]) -> None:
        should_retry = payload.pop("_should_retry", None)
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Request-Id", f"req_fake_{id(payload)}")
        if should_retry is not None:
            self.send_header("Stripe-Should-Retry", "true" if should_retry else "false")
        self.end_headers()
        self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, fake: FakeStripe) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.fake = fake


@contextmanager
def running(now: Callable[[], datetime] | None = None) -> Iterator[FakeStripe]:
    """A fake Stripe listening on a free loopback port until the block ends."""
    fake = FakeStripe(now)
    server = _Server(fake)
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="fake-stripe", daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
