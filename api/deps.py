"""Request dependencies, defined once as `Annotated` aliases that routes take as parameters."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader
from sqlalchemy.orm import Session as OrmSession

from api import request_context
from api.ratelimit import TokenBuckets
from api.readiness import Readiness
from core import apikeys
from core.apikeys import Principal
from core.clock import Clock
from core.db import Database
from core.errors import PermissionDenied
from core.objectstore import ArtifactStore
from core.settings import Settings
from scheduler.dispatch import Dispatcher
from scheduler.notify import Notifier


@dataclasses.dataclass
class AppState:
    """Everything a request may need, built once by `create_app`."""

    settings: Settings
    database: Database
    clock: Clock
    server_secret: bytes
    telemetry_limiter: TokenBuckets
    notifier: Notifier
    dispatcher: Dispatcher
    store: ArtifactStore
    readiness: Readiness


async def get_state(request: Request) -> AppState:
    # A coroutine, so FastAPI calls it on the event loop: a plain function would cost every
    # request a hop to the thread pool and back for one attribute read.
    state: AppState = request.app.state.treadle
    return state


State = Annotated[AppState, Depends(get_state)]


def get_db_session(state: State) -> Iterator[OrmSession]:
    with state.database.transaction() as session:
        yield session


DbSession = Annotated[OrmSession, Depends(get_db_session)]
"""A write transaction, committed after the route returned (for routes that change rows, such
as a session found expired on reading it)."""


def get_read_session(state: State) -> Iterator[OrmSession]:
    with state.database.reader() as session:
        yield session


ReadSession = Annotated[OrmSession, Depends(get_read_session)]
"""A read-only transaction: never waits for the database's write lock."""


# Declared as a security scheme so the OpenAPI document says which routes need the key and how
# to send it; authenticate() writes the error (auto_error would answer 403 without our body).
API_KEY_HEADER = APIKeyHeader(
    name="X-API-Key",
    scheme_name="ApiKey",
    description="A Treadle API key, `tml-<key id>-<secret>`.",
    auto_error=False,
)


def get_principal(state: State, raw: Annotated[str | None, Security(API_KEY_HEADER)]) -> Principal:
    return authenticate(state, raw)


def authenticate(state: AppState, raw: str | None) -> Principal:
    """The principal of API key `raw`, however it was sent."""
    # A read, so authentication never waits for the database's write lock; the last-used time
    # is written at most once a minute per key.
    with state.database.rows() as db:
        principal = apikeys.authenticate(db, state.clock, state.server_secret, raw)
    if principal.stale_last_used:
        with state.database.transaction() as db:
            apikeys.touch(db, state.clock, principal.key_id)
    request_context.note_tenant(principal.tenant_id)
    return principal


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]


def get_admin(principal: CurrentPrincipal) -> Principal:
    if not principal.is_admin:
        raise PermissionDenied("this endpoint needs an admin-scope API key")
    return principal


AdminPrincipal = Annotated[Principal, Depends(get_admin)]
