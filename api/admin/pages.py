"""`/admin/*`: the dashboard's server-rendered pages, logging in and out, and its files.

Pages render what `api.admin.overview`, `api.admin.usage` and `api.admin.billing` read (the
usage page's charts fetch `/admin/api/usage`; the live and fleet tables are fetched again by
htmx). Logging in trades an admin key for the session cookie (`api.admin.cookies`):
HTTP-only, `SameSite=Strict`, scoped to `/admin`, and `Secure` when the request came over
https or `admin_secure_cookie` is `always`. Logging in and out are written to the audit log, as the
forms' changes are. Pages, scripts and styles come from this server alone; `api.admin.forms`
takes the forms that change something.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy.orm import Session as OrmSession

from api.admin import cookies, overview
from api.admin.auth import Admin, PageAdmin, check_csrf, session_of
from api.admin.billing import billing_view
from api.admin.render import HEADERS, HERE, Form, moment, redirect, render, root, tenants_page
from api.admin.usage import (
    TOP_SERIES,
    UsageQuery,
    check_range,
    default_range,
    parse_range,
)
from api.deps import AppState, State, authenticate
from billing.stripe_push import RESEND_WITHIN
from core import audit
from core.errors import AuthenticationFailed, InvalidInput, NotFound, PermissionDenied
from core.tables import ApiKey

router = APIRouter(prefix="/admin", include_in_schema=False)

_STATIC = HERE / "static"
_ASSETS = {
    "admin.js": "text/javascript; charset=utf-8",
    "admin.css": "text/css; charset=utf-8",
    "admin.png": "image/png",
    "vendor/htmx.min.js": "text/javascript; charset=utf-8",
    "vendor/chart.umd.min.js": "text/javascript; charset=utf-8",
}
REFRESH_SECONDS = 5


@router.get("")
def home(request: Request) -> RedirectResponse:
    return redirect(request, "usage")


@router.get("/login")
def login_page(request: Request, state: State) -> Response:
    if session_of(state, request) is not None:
        return redirect(request, "usage")
    return render(request, state, None, "login", title="Log in", error=None)


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
        return render(
            request, state, None, "login", status, title="Log in", error=f"{status}: {refused}"
        )
    _audit(state, principal.key_id, principal.tenant_id, "admin.logged_in")
    response = redirect(request, "usage")
    response.set_cookie(
        cookies.COOKIE_NAME,
        cookies.issue(state.server_secret, principal.key_id, state.clock.now()),
        max_age=int(cookies.SESSION_LIFETIME.total_seconds()),
        path=f"{root(request)}/admin",
        httponly=True,
        samesite="strict",
        secure=_secure(request, state),
    )
    return response


@router.post("/logout")
def logout(request: Request, state: State, admin: PageAdmin, form: Form) -> Response:
    check_csrf(state, admin, form.get("csrf"))
    _audit(state, admin.key_id, _tenant_of(state, admin), "admin.logged_out")
    response = redirect(request, "login")
    response.delete_cookie(
        cookies.COOKIE_NAME,
        path=f"{root(request)}/admin",
        httponly=True,
        samesite="strict",
        secure=_secure(request, state),
    )
    return response


def _secure(request: Request, state: AppState) -> bool:
    return state.settings.admin_secure_cookie == "always" or request.url.scheme == "https"


def _tenant_of(state: AppState, admin: Admin) -> str | None:
    with state.database.reader() as db:
        key = db.get(ApiKey, admin.key_id)
        return None if key is None else key.tenant_id


def _audit(state: AppState, key_id: str, tenant_id: str | None, action: str) -> None:
    """The key that logged in or out is both the actor and the target."""
    with state.database.transaction() as db:
        audit.record(
            db, state.clock, tenant_id=tenant_id, actor=key_id, action=action, target=key_id
        )


@router.get("/usage")
def usage_page(
    request: Request,
    state: State,
    admin: PageAdmin,
    query: Annotated[UsageQuery, Depends()],
) -> HTMLResponse:
    bucket, group = query.bucket, query.group
    error = None
    try:
        first, last = parse_range(query.start, query.end, state.clock.now())
        check_range(first, last, bucket)
    except InvalidInput as invalid:
        error, (first, last) = str(invalid), default_range(state.clock.now())
    dates = {"start": first.date().isoformat(), "end": last.date().isoformat()}
    link = urlencode(dates | {"bucket": bucket, "group": group})
    return render(
        request,
        state,
        admin,
        "usage",
        400 if error else 200,
        title="Usage",
        **dates,
        bucket=bucket,
        group=group,
        query=link,
        error=error,
        top_series=TOP_SERIES,
    )


def _refreshed_values(
    state: AppState, title: str, name: str, read: Callable[[OrmSession, datetime], object]
) -> dict[str, Any]:
    """A page that refreshes itself: what `read` finds now, under `name`, and when that was."""
    now = state.clock.now()
    with state.database.reader() as db:
        found = read(db, now)
    return {"title": title, name: found, "now": moment(now), "refresh_seconds": REFRESH_SECONDS}


def _live_values(state: AppState) -> dict[str, Any]:
    return _refreshed_values(
        state, "Live", "live", lambda db, now: overview.live(db, now, state.settings)
    ) | {
        "stuck_after": int(overview.STUCK_AFTER_SECONDS),
        "failed_shown": overview.FAILED_OPS_SHOWN,
    }


@router.get("/live")
def live_page(request: Request, state: State, admin: PageAdmin) -> HTMLResponse:
    return render(request, state, admin, "live", **_live_values(state))


@router.get("/live/tables")
def live_tables(request: Request, state: State, admin: PageAdmin) -> HTMLResponse:
    """The live page's tables alone, swapped in by htmx every few seconds."""
    return render(request, state, admin, "live_tables", **_live_values(state))


def _fleet_values(state: AppState) -> dict[str, Any]:
    return _refreshed_values(state, "Fleet", "fleet", overview.fleet_view)


@router.get("/fleet")
def fleet_page(request: Request, state: State, admin: PageAdmin) -> HTMLResponse:
    return render(request, state, admin, "fleet", **_fleet_values(state))


@router.get("/fleet/tables")
def fleet_tables(request: Request, state: State, admin: PageAdmin) -> HTMLResponse:
    return render(request, state, admin, "fleet_tables", **_fleet_values(state))


@router.get("/tenants")
def tenants_view(request: Request, state: State, admin: PageAdmin) -> HTMLResponse:
    return tenants_page(request, state, admin)


@router.get("/billing")
def billing_page(request: Request, state: State, admin: PageAdmin) -> HTMLResponse:
    """Stripe's lag and the latest reconciliation; not refreshed by itself, since pushes run
    minutes apart."""
    now = state.clock.now()
    with state.database.reader() as db:
        view = billing_view(db, now, state.settings)
    return render(
        request,
        state,
        admin,
        "billing",
        title="Billing",
        billing=view,
        now=moment(now),
        resend_hours=RESEND_WITHIN // timedelta(hours=1),
    )


@router.get("/static/{name:path}")
def asset(name: str) -> Response:
    """The dashboard's script and stylesheet, and the vendored htmx and Chart.js."""
    media_type = _ASSETS.get(name)
    if media_type is None:
        raise NotFound(f"no admin file {name!r}; its files are {', '.join(sorted(_ASSETS))}")
    headers = HEADERS | {"Cache-Control": "no-cache"}
    return Response((_STATIC / name).read_bytes(), media_type=media_type, headers=headers)
