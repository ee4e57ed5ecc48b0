"""`/admin/*`: the dashboard's server-rendered pages, its forms and its files.

Pages render what `api.admin.overview` and `api.admin.usage` read (the usage page's charts
fetch `/admin/api/usage`); forms change tenants and keys only through the core functions the
admin CLI calls (`core.tenants`, `core.apikeys`), with the admin key's id as the audit log's
actor. Every form post carries the session's CSRF token; the cookie is HTTP-only,
`SameSite=Strict`, and `Secure` when the request came over https. Pages, scripts and styles
come from this server alone, under a Content-Security-Policy that allows nothing else.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, urlencode

import jinja2
from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from api.admin import cookies, overview
from api.admin.auth import Admin, PageAdmin, check_csrf, session_of
from api.admin.usage import (
    TOP_SERIES,
    Bucket,
    Group,
    check_range,
    default_range,
    parse_moment,
)
from api.deps import AppState, State, authenticate
from billing.limits import dollars
from core import apikeys, tenants
from core.errors import AuthenticationFailed, InvalidInput, NotFound, PermissionDenied

router = APIRouter(prefix="/admin", include_in_schema=False)

REFRESH_SECONDS = 5
_HERE = Path(__file__).resolve().parent.parent
_STATIC = _HERE / "static"
_ASSETS = {
    "admin.js": "text/javascript; charset=utf-8",
    "admin.css": "text/css; charset=utf-8",
    "admin.png": "image/png",
    "vendor/htmx.min.js": "text/javascript; charset=utf-8",
    "vendor/chart.umd.min.js": "text/javascript; charset=utf-8",
}
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


def _moment(value: datetime) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S")


def _plain_dollars(micros: int) -> str:
    return str((Decimal(micros) / 1_000_000).normalize())


def _mebibytes(count: int) -> str:
    return f"{count / 2**20:,.1f} MiB"


_TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(_HERE / "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
)
_TEMPLATES.globals.update(
    moment=_moment, dollars=dollars, plain_dollars=_plain_dollars, mebibytes=_mebibytes
)


def _render(
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
        root=_root(request), csrf=csrf, page=name, **values
    )
    return HTMLResponse(html, status_code=status, headers=HEADERS)


def _root(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/")


def _redirect(request: Request, path: str) -> RedirectResponse:
    return RedirectResponse(f"{_root(request)}/admin/{path}", status_code=303, headers=HEADERS)


async def read_form(request: Request) -> dict[str, str]:
    """A url-encoded form's fields (the last value of each); an empty body has none."""
    body = await request.body()
    form_type = "application/x-www-form-urlencoded"
    if body and not request.headers.get("content-type", "").startswith(form_type):
        raise InvalidInput(f"send this form as {form_type}")
    fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return {name: values[-1] for name, values in fields.items()}


Form = Annotated[dict[str, str], Depends(read_form)]


@router.get("")
def home(request: Request) -> RedirectResponse:
    return _redirect(request, "usage")


@router.get("/login")
def login_page(request: Request, state: State) -> Response:
    if session_of(state, request) is not None:
        return _redirect(request, "usage")
    return _render(request, state, None, "login", title="Log in", error=None)


@router.post("/login")
def login(request: Request, state: State, form: Form) -> Response:
    """Trade an admin key for a session cookie; the key itself is not kept."""
    try:
        principal = authenticate(state, form.get("key", ""))
        if not principal.is_admin:
            raise PermissionDenied(
                "this is a tenant key; the dashboard needs an admin-scope key "
                "(`treadle-server admin keys create --scope admin`)"
            )
    except (AuthenticationFailed, PermissionDenied) as refused:
        status = 401 if isinstance(refused, AuthenticationFailed) else 403
        return _render(
            request, state, None, "login", status, title="Log in", error=f"{status}: {refused}"
        )
    response = _redirect(request, "usage")
    response.set_cookie(
        cookies.COOKIE_NAME,
        cookies.issue(state.server_secret, principal.key_id, state.clock.now()),
        max_age=int(cookies.SESSION_LIFETIME.total_seconds()),
        path=f"{_root(request)}/admin",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.post("/logout")
def logout(request: Request, state: State, admin: PageAdmin, form: Form) -> Response:
    check_csrf(state, admin, form.get("csrf"))
    response = _redirect(request, "login")
    response.delete_cookie(
        cookies.COOKIE_NAME,
        path=f"{_root(request)}/admin",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.get("/usage")
def usage_page(
    request: Request,
    state: State,
    admin: PageAdmin,
    start: str | None = None,
    end: str | None = None,
    bucket: Bucket = "day",
    group: Group = "tenant",
) -> HTMLResponse:
    first, last = default_range(state.clock.now())
    error = None
    try:
        first = first if start is None else parse_moment(start, "start")
        last = last if end is None else parse_moment(end, "end")
        check_range(first, last, bucket)
    except InvalidInput as invalid:
        error, (first, last) = str(invalid), default_range(state.clock.now())
    dates = {"start": first.date().isoformat(), "end": last.date().isoformat()}
    query = urlencode(dates | {"bucket": bucket, "group": group})
    return _render(
        request,
        state,
        admin,
        "usage",
        400 if error else 200,
        title="Usage",
        **dates,
        bucket=bucket,
        group=group,
        query=query,
        error=error,
        top_series=TOP_SERIES,
    )


def _live_values(state: AppState) -> dict[str, Any]:
    now = state.clock.now()
    with state.database.reader() as db:
        live = overview.live(db, now, state.settings)
    return {
        "title": "Live",
        "live": live,
        "now": _moment(now),
        "refresh_seconds": REFRESH_SECONDS,
        "stuck_after": int(overview.STUCK_AFTER_SECONDS),
        "failed_shown": overview.FAILED_OPS_SHOWN,
    }


@router.get("/live")
def live_page(request: Request, state: State, admin: PageAdmin) -> HTMLResponse:
    return _render(request, state, admin, "live", **_live_values(state))


@router.get("/live/tables")
def live_tables(request: Request, state: State, admin: PageAdmin) -> HTMLResponse:
    """The live page's tables alone, swapped in by htmx every few seconds."""
    return _render(request, state, admin, "live_tables", **_live_values(state))


def _fleet_values(state: AppState) -> dict[str, Any]:
    now = state.clock.now()
    with state.database.reader() as db:
        fleet = overview.fleet_view(db, now)
    return {
        "title": "Fleet",
        "fleet": fleet,
        "now": _moment(now),
        "refresh_seconds": REFRESH_SECONDS,
    }


@router.get("/fleet")
def fleet_page(request: Request, state: State, admin: PageAdmin) -> HTMLResponse:
    return _render(request, state, admin, "fleet", **_fleet_values(state))


@router.get("/fleet/tables")
def fleet_tables(request: Request, state: State, admin: PageAdmin) -> HTMLResponse:
    return _render(request, state, admin, "fleet_tables", **_fleet_values(state))


def _tenants_page(
    request: Request,
    state: AppState,
    admin: Admin,
    *,
    status: int = 200,
    error: str | None = None,
    created: dict[str, str] | None = None,
) -> HTMLResponse:
    with state.database.reader() as db:
        rows = overview.tenant_rows(db, state.clock.now())
        keys = overview.key_rows(db)
    return _render(
        request,
        state,
        admin,
        "tenants",
        status,
        title="Tenants",
        tenants=rows,
        keys=keys,
        error=error,
        created=created,
    )


@router.get("/tenants")
def tenants_page(request: Request, state: State, admin: PageAdmin) -> HTMLResponse:
    return _tenants_page(request, state, admin)


def _whole(form: dict[str, str], name: str) -> int:
    try:
        return int(form.get(name, "").strip())
    except ValueError:
        raise InvalidInput(f"{name} {form.get(name, '')[:40]!r} is not a whole number") from None


def _micros(text: str) -> int | None:
    """Dollars as micro-units; blank: no limit."""
    if not text.strip():
        return None
    try:
        amount = Decimal(text.strip().lstrip("$").replace(",", "")) * 1_000_000
    except InvalidOperation:
        raise InvalidInput(
            f"monthly limit {text[:40]!r} is not an amount of dollars; write e.g. 250 or 99.50, "
            "or leave it blank for no limit"
        ) from None
    return int(amount.to_integral_value())


@router.post("/tenants/{tenant_id}/limits")
def change_limits(
    request: Request, state: State, admin: PageAdmin, form: Form, tenant_id: str
) -> Response:
    """Set a tenant's session quota, LoRA rank ceiling and monthly spend limit."""
    check_csrf(state, admin, form.get("csrf"))
    try:
        sessions, rank = _whole(form, "max_concurrent_sessions"), _whole(form, "max_lora_rank")
        monthly = _micros(form.get("monthly_dollars", ""))
        with state.database.transaction() as db:
            tenant = tenants.find_tenant(db, tenant_id)
            tenants.update_tenant_limits(
                db,
                tenant,
                clock=state.clock,
                actor=admin.actor,
                max_concurrent_sessions=sessions,
                max_lora_rank=rank,
            )
            tenants.set_spend_limits(
                db, state.clock, tenant, monthly_micros=monthly, actor=admin.actor
            )
    except (InvalidInput, NotFound) as refused:
        return _tenants_page(request, state, admin, status=422, error=str(refused))
    return _redirect(request, "tenants")


@router.post("/keys")
def create_key(request: Request, state: State, admin: PageAdmin, form: Form) -> Response:
    """Issue a key; the page shows its plain text this once."""
    check_csrf(state, admin, form.get("csrf"))
    try:
        with state.database.transaction() as db:
            tenant = tenants.find_tenant(db, form.get("tenant_id", ""))
            row, key = apikeys.issue_api_key(
                db,
                state.clock,
                state.server_secret,
                tenant,
                name=form.get("name", "").strip(),
                scope=form.get("scope", ""),
                actor=admin.actor,
            )
            created = {
                "key_id": row.id,
                "scope": row.scope,
                "tenant_name": tenant.name,
                "key": key,
            }
    except (InvalidInput, NotFound) as refused:
        return _tenants_page(request, state, admin, status=422, error=str(refused))
    return _tenants_page(request, state, admin, created=created)


@router.post("/keys/{key_id}/revoke")
def revoke_key(
    request: Request, state: State, admin: PageAdmin, form: Form, key_id: str
) -> Response:
    check_csrf(state, admin, form.get("csrf"))
    try:
        with state.database.transaction() as db:
            apikeys.revoke_api_key(db, state.clock, key_id, actor=admin.actor)
    except NotFound as refused:
        return _tenants_page(request, state, admin, status=404, error=str(refused))
    return _redirect(request, "tenants")


@router.get("/static/{name:path}")
def asset(name: str) -> Response:
    """The dashboard's script and stylesheet, and the vendored htmx and Chart.js."""
    media_type = _ASSETS.get(name)
    if media_type is None:
        raise NotFound(f"no admin file {name!r}; its files are {', '.join(sorted(_ASSETS))}")
    headers = HEADERS | {"Cache-Control": "no-cache"}
    return Response((_STATIC / name).read_bytes(), media_type=media_type, headers=headers)
