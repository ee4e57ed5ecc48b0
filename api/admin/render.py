"""What the dashboard's pages and forms share: its templates, the headers every answer carries
(a Content-Security-Policy that allows this server alone, no framing, no caching), rendering
with the session's CSRF token, redirects behind the server's root path, and url-encoded forms
(read here, since the server has no multipart parser).
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs

import jinja2
from fastapi import Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from sqlalchemy import func, select
from sqlalchemy.orm import Session as OrmSession

from api.admin import cookies, overview
from api.admin.auth import Admin
from api.deps import AppState
from billing.limits import dollars
from core.errors import InvalidInput
from core.tables import ApiKey

HERE = Path(__file__).resolve().parent.parent
CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "img-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    )
)
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def moment(value: datetime) -> str:
    """A UTC time as the pages show it."""
    return value.strftime("%Y-%m-%d %H:%M:%S")


def _plain_dollars(micros: int) -> str:
    return format((Decimal(micros) / 1_000_000).normalize(), "f")  # 100, not 1E+2


def _mebibytes(count: int) -> str:
    return f"{count / 2**20:,.1f} MiB"


def duration(seconds: float) -> str:
    """A span as the pages show it, to the minute: `3 d 4 h`, `2 h 5 min`, `7 min`."""
    minutes = max(int(seconds) // 60, 0)
    days, hours = divmod(minutes // 60, 24)
    if days:
        return f"{days} d {hours} h"
    return f"{hours} h {minutes % 60} min" if hours else f"{minutes} min"


_TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(HERE / "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
)
_TEMPLATES.globals.update(
    moment=moment,
    dollars=dollars,
    plain_dollars=_plain_dollars,
    mebibytes=_mebibytes,
    duration=duration,
)


def render(
    request: Request,
    state: AppState,
    admin: Admin | None,
    name: str,
    status: int = 200,
    **values: Any,
) -> HTMLResponse:
    csrf = None
    if admin is not None and admin.session is not None:
        csrf = cookies.csrf_token(state.server_secret, admin.session)
    elif admin is not None:
        csrf = ""  # the key came in a header: forms need no token
    html = _TEMPLATES.get_template(f"admin/{name}.html").render(
        root=root(request), csrf=csrf, page=name, **values
    )
    return HTMLResponse(html, status_code=status, headers=HEADERS)


def root(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/")


def redirect(request: Request, path: str) -> RedirectResponse:
    return RedirectResponse(f"{root(request)}/admin/{path}", status_code=303, headers=HEADERS)


async def read_form(request: Request) -> dict[str, str]:
    """A url-encoded form's fields (the last value of each); an empty body has none."""
    body = await request.body()
    form_type = "application/x-www-form-urlencoded"
    if body and not request.headers.get("content-type", "").startswith(form_type):
        raise InvalidInput(f"send this form as {form_type}")
    fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return {name: values[-1] for name, values in fields.items()}


Form = Annotated[dict[str, str], Depends(read_form)]


def keys_issued(db: OrmSession) -> int:
    """How many keys were ever issued: the key form sends it back, so that the same form sent
    twice is refused rather than issuing a second key."""
    return db.scalar(select(func.count()).select_from(ApiKey)) or 0


def tenants_page(
    request: Request,
    state: AppState,
    admin: Admin,
    *,
    status: int = 200,
    error: str | None = None,
    created: dict[str, str] | None = None,
) -> HTMLResponse:
    with state.database.reader() as db:
        now = state.clock.now()
        rows, keys = overview.tenant_rows(db, now), overview.key_rows(db, now)
        issued = keys_issued(db)
    return render(
        request,
        state,
        admin,
        "tenants",
        status,
        title="Tenants",
        tenants=rows,
        keys=keys,
        keys_issued=issued,
        error=error,
        created=created,
    )
