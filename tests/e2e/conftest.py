"""A running embedded Treadle server per test module, for driving real clients."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI

from api.app import create_app
from api.dbschema import upgrade
from core.db import Database
from tests.conftest import TenantFactory, make_settings, tenant_factory
from tests.server import running_server


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


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from start_server(tmp_path_factory.mktemp("server"))


@pytest.fixture(autouse=True)
def _no_stored_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
