"""Build a Treadle API app on a migrated database; run one under a real uvicorn server on a
free local port, in a thread; and a whole embedded server (database, engine, tenants) for
driving real clients."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


def tinker_cli(base_url: str, api_key: str, home: Path, *args: str) -> Any:
    """Run the official `tinker` CLI in this process against `base_url` (a subprocess spends
    seconds importing tinker) and return its JSON output.

    The SDK keeps one session-less connection per (base URL, API key) *argument* for the life of
    the process, and the CLI passes neither (it reads them from the environment), so the first
    invocation's server would serve every later one: the entry is dropped around each run.
    """
    from click.testing import CliRunner
    from tinker.cli.__main__ import main_cli
    from tinker.lib.internal_client_holder import sessionless_holder_cache

    env = {"HOME": str(home), "TINKER_BASE_URL": base_url, "TINKER_API_KEY": api_key}
    holders = sessionless_holder_cache._holders
    holders.pop((None, None), None)
    try:
        result = CliRunner().invoke(
            main_cli, ["-f", "json", *args], env=env, catch_exceptions=False
        )
    finally:
        holders.pop((None, None), None)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)
