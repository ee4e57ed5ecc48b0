"""Run a Treadle API app under a real uvicorn server on a free local port, in a thread; and a
whole embedded server (database, engine, tenants) for driving real clients."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from api.app import create_app
from api.dbschema import upgrade
from core.db import Database
from tests.builders import TenantFactory, make_settings, tenant_factory
from tests.services import free_port


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
    url = f"sqlite:///{root / 'treadle.db'}"
    upgrade(Database(url))
    settings = make_settings(root, url, **settings_overrides)
    app = create_app(settings)
    database = app.state.treadle.database
    with running_server(app) as base_url:
        assert app.state.treadle.dispatcher.wait_ready(120), "engine did not start"
        yield LiveServer(base_url, database, tenant_factory(database, settings), app)
