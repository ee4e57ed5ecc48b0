"""`GET /chat`: a browser page for chatting with your models through `/oai/v1`.

The page is static HTML, a script and a stylesheet: it holds no tenant data and no secret. The
visitor pastes an API key, which the script keeps in the tab's `sessionStorage` and sends as
`Authorization: Bearer <key>` to `/oai/v1/models` and `/oai/v1/chat/completions` (streamed), so
authentication, isolation and metering are those of the OpenAI-compatible API. This module knows
nothing of models or sampling. The page loads nothing from another origin, and its
Content-Security-Policy lets it load nothing but its own files and talk to nothing but this
server.

These routes are kept out of the OpenAPI document: they are a page for browsers, not API.
"""

from __future__ import annotations

from pathlib import Path

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from api.oai_params import DEFAULT_MAX_TOKENS
from core.errors import NotFound

router = APIRouter(include_in_schema=False)

_HERE = Path(__file__).resolve().parent.parent
_TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(_HERE / "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
)
_STATIC = _HERE / "static"
_ASSETS = {"chat.js": "text/javascript; charset=utf-8", "chat.css": "text/css; charset=utf-8"}

CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "img-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
# Sent with the page and its files: no framing (clickjacking), no MIME sniffing, no referrer.
_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@router.get("/chat", response_class=HTMLResponse)
def chat_page(request: Request) -> HTMLResponse:
    """The chat page; every URL in it is a path on this server (behind its root path)."""
    root = request.scope.get("root_path", "").rstrip("/")
    html = _TEMPLATES.get_template("chat.html").render(
        root=root, api=f"{root}/oai/v1", default_max_tokens=DEFAULT_MAX_TOKENS
    )
    return HTMLResponse(html, headers=_HEADERS)


@router.get("/chat/{name}")
def chat_asset(name: str) -> Response:
    """The page's script and stylesheet; any other name is a 404."""
    media_type = _ASSETS.get(name)
    if media_type is None:
        raise NotFound(f"no chat page file {name!r}; its files are {', '.join(sorted(_ASSETS))}")
    return Response((_STATIC / name).read_bytes(), media_type=media_type, headers=_HEADERS)
