"""Prometheus metrics of an API process: request latency by route, the 402 and 429 answers, ops
submitted, and the `/metrics` route that serves them with the process's other metrics.

Labels name the route's template (`/api/v1/training_runs/{run_id}`), never the URL a client
sent, so ids never become series. `/metrics` on the API's own port needs
`Authorization: Bearer <TREADLE_METRICS_TOKEN>`, and while no token is set answers the 404 of
any unknown path (off by default on the public port; the app logs how to turn it on as it
starts); TREADLE_METRICS_PORT serves the same metrics on a separate port without a token. The route is left out of the OpenAPI document: it is for operators' scrapers,
not for clients. What the host records is counted by `scheduler.metrics`; the fleet's gauges
(`scheduler.fleet_gauges`) are added by the embedded server only: in distributed mode beat
exports them.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.deps import State
from core.settings import Settings
from scheduler.metrics import LATENCY_BUCKETS
from scheduler.submit import Submitted

UNMATCHED = "<unmatched>"
"""The route label of a request no route matched (the path itself could be anything)."""

# A client may send any method name: others are labelled `other`, so they add one series.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})

REQUEST_SECONDS = Histogram(
    "treadle_http_request_duration_seconds",
    "Time to answer a request, from its arrival to its last byte, by route template, method "
    "and status class (2xx, 4xx, ...); long-polls of futures last up to TREADLE_LONG_POLL_SECONDS.",
    ["route", "method", "status_class"],
    buckets=LATENCY_BUCKETS,
)
REFUSALS = Counter(
    "treadle_http_refusals_total",
    "402 (spend limit reached) and 429 (rate or queue limit) answers, by status, the error "
    "code of the answer's body and route template.",
    ["status", "reason", "route"],
)
OPS_SUBMITTED = Counter(
    "treadle_ops_submitted_total",
    "Operations queued by this API process, by kind (a resubmitted request is not counted "
    "again, nor one failed as it arrived).",
    ["kind"],
)


def route_template(scope: Scope) -> str:
    """The template of the route that answered (`/api/v1/training_runs/{run_id}`), or
    UNMATCHED."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else UNMATCHED


def _reason(body: bytes) -> str:
    """The error code of an answer's body: Treadle's `{"code": ...}`, or under `/oai/` OpenAI's
    `{"error": {"code": ...}}`."""
    try:
        answer = json.loads(body)
    except ValueError:
        return "unknown"
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        answer = answer["error"]
    code = answer.get("code") if isinstance(answer, dict) else None
    return code if isinstance(code, str) else "unknown"


class RequestMetrics:
    """ASGI middleware timing each HTTP request and counting its 402 and 429 answers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # an exception before the answer started is answered 500
        refusal = bytearray()

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status in (402, 429):
                refusal.extend(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = route_template(scope)
            method = scope["method"] if scope["method"] in METHODS else "other"
            REQUEST_SECONDS.labels(route, method, f"{status // 100}xx").observe(
                time.perf_counter() - started
            )
            if status in (402, 429):
                REFUSALS.labels(str(status), _reason(bytes(refusal)), route).inc()


def count_submitted(submitted: Submitted) -> None:
    """Count a new op once its submission committed. Resubmissions and requests failed as they
    arrived are not counted, so submitted minus finished stays the ops in flight."""
    if submitted.queued_kind is not None:
        OPS_SUBMITTED.labels(submitted.queued_kind).inc()


router = APIRouter()


OFF_HINT = (
    "/metrics is off on the API's port: set TREADLE_METRICS_TOKEN to serve it there to scrapers "
    "sending `Authorization: Bearer <token>`, or TREADLE_METRICS_PORT to serve it on a separate "
    "port"
)
"""Logged as the app starts without a token; never answered, so callers learn nothing."""


def check_token(settings: Settings, authorization: str | None) -> None:
    """Refuse a scrape of the API's port without the metrics token, or any while none is set
    (answered as an unknown path)."""
    if settings.metrics_token is None:
        raise HTTPException(status_code=404)
    scheme, _, token = (authorization or "").partition(" ")
    expected = settings.metrics_token.get_secret_value()
    # The token is compared in constant time whatever the scheme, so timing tells nothing.
    matches = secrets.compare_digest(token.strip().encode(), expected.encode())
    if scheme.lower() != "bearer" or not matches:
        raise HTTPException(
            status_code=401,
            detail="/metrics needs `Authorization: Bearer <token>` with the server's "
            "TREADLE_METRICS_TOKEN; send that header",
            headers={"WWW-Authenticate": "Bearer"},
        )


@router.get("/metrics", include_in_schema=False)
def metrics(
    request: Request, state: State, authorization: Annotated[str | None, Header()] = None
) -> Response:
    check_token(state.settings, authorization)
    registry: CollectorRegistry = request.app.state.metrics
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
