"""Request dependencies, defined once as `Annotated` aliases that routes take as parameters."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session as OrmSession

from api.ratelimit import TokenBuckets
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


def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.treadle
    return state


State = Annotated[AppState, Depends(get_state)]


def get_db_session(state: State) -> Iterator[OrmSession]:
    with state.database.transaction() as session:
        yield session


DbSession = Annotated[OrmSession, Depends(get_db_session)]


def get_principal(request: Request, state: State) -> Principal:
    raw = request.headers.get("x-api-key")
    # A read, so authentication never waits for the database's write lock; the last-used time
    # is written at most once a minute per key.
    with state.database.reader() as db:
        principal = apikeys.authenticate(db, state.clock, state.server_secret, raw)
    if principal.stale_last_used:
        with state.database.transaction() as db:
            apikeys.touch(db, state.clock, principal.key_id)
    return principal


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]


def get_admin(principal: CurrentPrincipal) -> Principal:
    if not principal.is_admin:
        raise PermissionDenied("this endpoint needs an admin-scope API key")
    return principal


AdminPrincipal = Annotated[Principal, Depends(get_admin)]
