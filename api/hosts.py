"""Refusing requests addressed to a host name this server does not answer for.

Without `TREADLE_PUBLIC_URL`, the URLs the API hands out (signed checkpoint downloads) start
with the request's own `Host` header, which the client chooses. With `TREADLE_ALLOWED_HOSTS`
set, a request whose `Host` is not on that list is refused before any route runs, so such URLs
only ever name hosts the operator listed.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import for_scope
from api.validation import clip
from core.errors import ErrorCode


def host_allowed(host: str, patterns: Sequence[str]) -> bool:
    """Whether `host` (without port) matches a pattern: an exact name, `*.domain` (its
    subdomains) or `*` (any)."""
    host = host.lower()
    for pattern in patterns:
        if pattern == "*" or host == pattern:
            return True
        if pattern.startswith("*.") and host.endswith(pattern[1:]):
            return True
    return False


def _without_port(host: str) -> str:
    if host.startswith("["):  # [::1]:8000
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class AllowedHosts:
    """Answers 400 unless the request's `Host` header matches one of `patterns`."""

    def __init__(self, app: ASGIApp, patterns: Sequence[str]) -> None:
        self.app = app
        self.patterns = [p.strip().lower() for p in patterns if p.strip()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = Headers(scope=scope).get("host", "")
        if host_allowed(_without_port(host), self.patterns):
            await self.app(scope, receive, send)
            return
        shown = clip(host, 100) if host else "(none)"
        response = for_scope(
            scope,
            400,
            ErrorCode.HOST_NOT_ALLOWED,
            f"this server does not answer for host {shown!r}; address it by one of its "
            f"names: {', '.join(self.patterns)}",
        )
        await response(scope, receive, send)
