"""Build a Treadle API app on a migrated database; run one under a real uvicorn server on a
free local port, in a thread; and a whole embedded server (database, engine, tenants) for
driving real clients."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from api.app import create_app
from api.dbschema import upgrade
from core.clock import Clock
from core.db import Database
from tests.builders import TenantFactory, make_settings, tenant_factory
from tests.services import free_port

AppFactory = Callable[..., FastAPI]
"""`build_app` with its root given: the `app_factory` fixture."""


def build_app(
    root: Path,
    database_url: str | None = None,
    *,
    clock: Clock | None = None,
    **settings_overrides: object,
) -> FastAPI:
    """A Treadle app on a migrated database (SQLite under `root` unless a URL is given), its
    settings made by `make_settings`; the app's state holds the settings and the database."""
    url = database_url or f"sqlite:///{root / 'treadle.db'}"
    upgrade(Database(url))
    return create_app(make_settings(root, url, **settings_overrides), clock=clock)


@contextlib.contextmanager
def running_server(app: FastAPI) -> Iterator[str]:
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server failed to start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@dataclasses.dataclass
class LiveServer:
    base_url: str
    database: Database
    make_tenant: TenantFactory
    app: FastAPI


def start_server(root: Path, **settings_overrides: object) -> Iterator[LiveServer]:
    root.mkdir(parents=True, exist_ok=True)
    app = build_app(root, **settings_overrides)
    state = app.state.treadle
    with running_server(app) as base_url:
        assert state.dispatcher.wait_ready(120), "engine did not start"
        yield LiveServer(
            base_url, state.database, tenant_factory(state.database, state.settings), app
        )
