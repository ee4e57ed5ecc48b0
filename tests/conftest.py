"""Shared fixtures: real databases, settings, tenants with keys, running servers."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

from api import dbschema
from core.db import Database
from tests import services
from tests.server import AppFactory, build_app

if TYPE_CHECKING:
    from tests.fakes.s3 import S3Server


@pytest.fixture(scope="session")
def postgres_admin_url() -> Iterator[str]:
    with services.postgres_server() as url:
        yield url


@pytest.fixture
def postgres_url(postgres_admin_url: str) -> Iterator[str]:
    with services.throwaway_database(postgres_admin_url) as url:
        yield url


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with services.redis_server() as url:
        yield url


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """An S3-compatible server (moto) on loopback for the whole test session."""
    from tests.fakes.s3 import s3_server as start

    with start() as server:
        yield server


@pytest.fixture
def s3_artifact_url(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket's `s3://bucket/artifacts` URL, with this process's AWS variables pointing
    at the test server (child processes inherit them)."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return s3_server.bucket()


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty database of each supported kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'treadle.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'treadle.db'}"


@pytest.fixture
def migrated(database_url: str) -> Database:
    database = Database(database_url)
    dbschema.upgrade(database)
    return database


@pytest.fixture
def app_factory(tmp_path: Path) -> AppFactory:
    """`app_factory(database_url=None, *, clock=None, **settings)`: a Treadle app on a migrated
    database, its data under this test's `tmp_path` (its SQLite file too, unless a URL is
    given). Enter `TestClient(app)` or `running_server(app)` to start it."""
    return functools.partial(build_app, tmp_path)


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """Restore the process's logging after each test. Commands run in-process (a CLI runner's
    `migrate`, `serve`) configure logging for the whole process (`core.logs.configure`): root
    handler and level, uvicorn's loggers, alembic's level, warnings captured; libraries do as
    well (MLflow gives the `alembic` logger a handler of its own and stops it propagating).
    Every logger that exists when the test starts gets back its handlers, level, propagation
    and whether it is disabled. Without this, a test's outcome could depend on which test
    configured logging before it."""
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    saved = [(lg, lg.handlers[:], lg.propagate, lg.level, lg.disabled) for lg in loggers]
    yield
    for lg, handlers, propagate, level, disabled in saved:
        if lg.handlers != handlers:
            lg.handlers[:] = handlers
        lg.propagate, lg.disabled = propagate, disabled
        if lg.level != level:  # setLevel clears every logger's cache: only where it changed
            lg.setLevel(level)
    logging.captureWarnings(False)
