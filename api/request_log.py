"""One log line per HTTP request (logger `treadle.access`), in place of uvicorn's access line,
and the request id that ties it to the client and to the op the request submitted.

The id is the client's `X-Request-Id` when it is one Treadle can log safely, else a new one
(`api.request_context`); answers carry it back in `X-Request-Id`. The line names the route's
template as the metrics do (`api.metrics.route_template`), so no id of a run or future is in
it, with the status, the time to the last byte, the client's address (the peer's host as the
server saw it: a proxy's, behind one) and what the route noted: the tenant, and the op it
queued with the op's target. Nothing of the line is built while INFO is not logged. The worker's line for that op (`scheduler.worker.op_lines`)
carries the same op id.

This module does not decide how lines look (`core.logs` does) nor authenticate anyone.
"""

from __future__ import annotations

import logging
import time

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.metrics import route_template
from api.request_context import HEADER, RequestFacts, opened, request_id_of

log = logging.getLogger("treadle.access")


def _fields(
    method: str,
    route: str,
    status: int,
    duration_ms: float,
    client: str | None,
    facts: RequestFacts,
) -> dict[str, object]:
    """The line's fields, for a structured handler; those without a value are left out."""
    fields: dict[str, object] = {
        "request_id": facts.request_id,
        "method": method,
        "route": route,
        "status": status,
        "duration_ms": duration_ms,
    }
    if client is not None:
        fields["client"] = client
    for name in ("tenant_id", "op_id", "target_id"):
        if getattr(facts, name) is not None:
            fields[name] = getattr(facts, name)
    return fields


def _text(fields: dict[str, object]) -> str:
    """`GET /api/v1/training_runs/{run_id} 200 12.3 ms rid=... client=... tenant=...`."""
    line = (
        f"{fields['method']} {fields['route']} {fields['status']} "
        f"{fields['duration_ms']:.1f} ms rid={fields['request_id']}"
    )
    if "client" in fields:
        line += f" client={fields['client']}"
    if "tenant_id" in fields:
        line += f" tenant={fields['tenant_id']}"
    if "op_id" in fields:
        line += f" op={fields['op_id']} target={fields.get('target_id')}"
    return line


class RequestLog:
    """ASGI middleware: gives each HTTP request its id, returns it in `X-Request-Id` and logs
    the request's line once the answer is sent (or the app failed before answering)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        facts = RequestFacts(request_id_of(Headers(scope=scope).get(HEADER)))
        status = 500  # an exception before the answer started is answered 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)[HEADER] = facts.request_id
            await send(message)

        try:
            with opened(facts, scope):
                await self.app(scope, receive, sending)
        finally:
            if log.isEnabledFor(logging.INFO):
                duration_ms = round((time.perf_counter() - started) * 1000, 1)
                fields = _fields(
                    scope["method"],
                    route_template(scope),
                    status,
                    duration_ms,
                    _client(scope),
                    facts,
                )
                log.info("%s", _text(fields), extra=fields)


def _client(scope: Scope) -> str | None:
    """The peer's host, without its port; None when the server names no peer."""
    peer = scope.get("client")
    return None if peer is None else str(peer[0])
