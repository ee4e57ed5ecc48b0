"""Who may use the dashboard: a browser holding an admin session cookie, or a client sending an
admin-scope API key in `X-API-Key` (so every JSON route can be called on its own).

A cookie counts only while its signature holds, it has not expired, and its key is still
unrevoked, admin-scoped and of an enabled tenant: one indexed read per request, so revoking a
key ends its dashboard sessions at once. A cookie session counts as a use of its key, as a key
sent in the header does: the key's last-used time is kept (at most once a minute) and the
request's access line names its tenant. A page asked for without a valid cookie redirects to
the login form (`LoginRequired`); a JSON route answers 401. A tenant-scope key is refused with
403 everywhere. Forms that change something carry the session's CSRF token (`check_csrf`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import select

from api import request_context
from api.admin import cookies
from api.deps import API_KEY_HEADER, AppState, State, authenticate
from core import apikeys
from core.errors import AuthenticationFailed, PermissionDenied
from core.tables import ApiKey, Tenant


class LoginRequired(Exception):
    """A page was asked for without a valid session: the app redirects to the login form."""


@dataclass(frozen=True)
class Admin:
    key_id: str
    session: cookies.AdminSession | None
    """None when the key came in the header (no cookie, so no CSRF token either)."""

    @property
    def actor(self) -> str:
        """Who the audit log names for changes made here."""
        return self.key_id


def session_of(state: AppState, request: Request) -> cookies.AdminSession | None:
    """The request's admin session, when its cookie is genuine, unexpired, and its key still
    an unrevoked admin key of an enabled tenant."""
    raw = request.cookies.get(cookies.COOKIE_NAME)
    if raw is None:
        return None
    session = cookies.verify(state.server_secret, raw, state.clock.now())
    if session is None:
        return None
    with state.database.reader() as db:
        row = db.execute(
            select(
                ApiKey.scope,
                ApiKey.revoked_at,
                ApiKey.last_used_at,
                ApiKey.tenant_id,
                Tenant.disabled,
            )
            .join(Tenant, Tenant.id == ApiKey.tenant_id)
            .where(ApiKey.id == session.key_id)
        ).one_or_none()
    if row is None or row.revoked_at is not None or row.disabled or row.scope != "admin":
        return None
    if apikeys.last_used_is_stale(row.last_used_at, state.clock.now()):
        with state.database.transaction() as db:
            apikeys.touch(db, state.clock, session.key_id)
    request_context.note_tenant(row.tenant_id)
    return session


def _admin_of_header(state: AppState, request: Request) -> Admin | None:
    raw = request.headers.get(API_KEY_HEADER.model.name)
    if raw is None:
        return None
    principal = authenticate(state, raw)
    if not principal.is_admin:
        raise PermissionDenied("the admin dashboard needs an admin-scope API key")
    return Admin(key_id=principal.key_id, session=None)


def _admin(state: AppState, request: Request) -> Admin | None:
    """A key sent in the header decides alone; else the session cookie, if valid."""
    admin = _admin_of_header(state, request)
    if admin is not None:
        return admin
    session = session_of(state, request)
    return None if session is None else Admin(key_id=session.key_id, session=session)


def get_api_admin(state: State, request: Request) -> Admin:
    admin = _admin(state, request)
    if admin is None:
        raise AuthenticationFailed(
            "no valid admin session: log in at /admin/login, or send an admin-scope API key "
            "in the X-API-Key header"
        )
    return admin


def get_page_admin(state: State, request: Request) -> Admin:
    admin = _admin(state, request)
    if admin is None:
        raise LoginRequired()
    return admin


ApiAdmin = Annotated[Admin, Depends(get_api_admin)]
PageAdmin = Annotated[Admin, Depends(get_page_admin)]


def check_csrf(state: AppState, admin: Admin, token: str | None) -> None:
    """Refuse a form post of a cookie session that lacks the session's CSRF token (a post made
    with the key in the header cannot be forged by another site, so it needs none)."""
    if admin.session is None:
        return
    if not cookies.csrf_matches(state.server_secret, admin.session, token):
        raise PermissionDenied(
            "this form lacks a valid CSRF token; reload the page and submit it again"
        )
