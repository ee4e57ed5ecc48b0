"""`/readyz` against real databases and Redis: ready when every check passes; not ready, naming
the failed check, when the database is unreachable or behind the migrations, or Redis (in
distributed mode) is unreachable; ready again once they are back. `/healthz` stays 200. And
the pool's pooled PostgreSQL connections after the server dropped them."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic.script import ScriptDirectory
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from api import dbschema
from api import readiness as readiness_module
from api.readiness import Readiness
from core import db as db_module
from core.db import Database
from tests.builders import make_settings
from tests.server import AppFactory
from tests.tcp_proxy import TcpProxy

pytestmark = pytest.mark.integration

FAST = {"readiness_check_seconds": 0.2}


def _proxied(url: str, proxy_for: list[TcpProxy]) -> str:
    """`url` through a new proxy (appended to `proxy_for`) in front of its host and port."""
    parsed = make_url(url)
    proxy = TcpProxy(parsed.host or "127.0.0.1", parsed.port or 0)
    proxy_for.append(proxy)
    return parsed.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)


@pytest.fixture
def proxies() -> Iterator[list[TcpProxy]]:
    started: list[TcpProxy] = []
    yield started
    for proxy in started:
        proxy.close()


def _wait_for(client: TestClient, status: int, seconds: float = 5.0) -> dict[str, Any]:
    """Poll `/readyz` until it answers `status` (the checks run in the background)."""
    deadline = time.monotonic() + seconds
    while True:
        answer = client.get("/api/v1/readyz")
        if answer.status_code == status or time.monotonic() > deadline:
            assert answer.status_code == status, answer.json()
            body: dict[str, Any] = answer.json()
            return body
        time.sleep(0.05)


def test_sqlite_app_is_ready_until_its_database_is_behind_the_migrations(
    app_factory: AppFactory,
) -> None:
    app = app_factory(**FAST)
    with TestClient(app) as client:
        assert _wait_for(client, 200) == {
            "status": "ready",
            "checks": {"database": "ok", "migrations": "ok"},
        }
        _stamp_previous_revision(app.state.treadle.database)
        body = _wait_for(client, 503)
        assert body["status"] == "not ready"
        assert body["checks"]["database"] == "ok"
        assert "treadle-server migrate" in body["checks"]["migrations"]
        assert client.get("/api/v1/healthz").status_code == 200


def _stamp_previous_revision(database: Database) -> None:
    """Mark the database one revision behind head, as an older release left it (downgrading
    for real would race the running engine's writes for SQLite's lock)."""
    head = dbschema.head_revision(database)
    scripts = ScriptDirectory.from_config(dbschema.alembic_config(database.url))
    previous = scripts.get_revision(head).down_revision
    assert isinstance(previous, str)
    with database.transaction() as db:
        db.execute(text("UPDATE alembic_version SET version_num = :rev"), {"rev": previous})


def test_unreachable_postgres_makes_the_app_not_ready_until_it_is_back(
    app_factory: AppFactory, postgres_url: str, proxies: list[TcpProxy]
) -> None:
    url = _proxied(postgres_url, proxies)
    app = app_factory(url, **FAST)
    with TestClient(app) as client:
        assert _wait_for(client, 200)["checks"] == {"database": "ok", "migrations": "ok"}
        proxies[0].stop()
        body = _wait_for(client, 503)
        assert body["status"] == "not ready"
        assert body["checks"]["database"].startswith("unreachable")
        assert str(proxies[0].port) not in str(body)  # no addresses for anonymous callers
        assert client.get("/api/v1/healthz").status_code == 200
        proxies[0].start()
        assert _wait_for(client, 200)["status"] == "ready"


def test_a_pooled_connection_the_database_dropped_is_replaced(
    postgres_url: str, proxies: list[TcpProxy], monkeypatch: pytest.MonkeyPatch
) -> None:
    database = Database(_proxied(postgres_url, proxies))

    def select_one() -> object:
        with database.rows() as connection:
            return connection.execute(text("SELECT 1")).scalar()

    try:
        assert select_one() == 1
        proxies[0].stop()  # cuts the pooled connection
        proxies[0].start()
        # Used a moment ago, it is not checked before use: the statement that finds it dead
        # fails, and the pool replaces its connections.
        with pytest.raises(OperationalError):
            select_one()
        assert select_one() == 1
        proxies[0].stop()
        proxies[0].start()
        # Idle for long enough (here at once), it is checked and replaced before use.
        monkeypatch.setattr(db_module, "PING_AFTER_IDLE_SECONDS", 0.0)
        assert select_one() == 1
    finally:
        database.dispose()


def test_distributed_app_is_not_ready_without_redis(
    app_factory: AppFactory, postgres_url: str, redis_url: str, proxies: list[TcpProxy]
) -> None:
    app = app_factory(postgres_url, redis_url=_proxied(redis_url, proxies), **FAST)
    with TestClient(app) as client:
        assert _wait_for(client, 200) == {
            "status": "ready",
            "checks": {"database": "ok", "migrations": "ok", "redis": "ok"},
        }
        proxies[0].stop()
        body = _wait_for(client, 503)
        assert body["checks"]["redis"].startswith("unreachable")
        assert body["checks"]["database"] == "ok"
        assert client.get("/api/v1/healthz").status_code == 200
        proxies[0].start()
        assert _wait_for(client, 200)["status"] == "ready"


def test_not_ready_before_the_first_check_and_once_checks_stop(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'treadle.db'}"
    database = Database(url)
    dbschema.upgrade(database)
    now = [100.0]
    readiness = Readiness(
        make_settings(tmp_path, url, readiness_check_seconds=1.0),
        database,
        monotonic=lambda: now[0],
    )
    first = readiness.report()
    assert not first.ready
    assert first.checks == {"database": "not checked yet", "migrations": "not checked yet"}
    asyncio.run(readiness.run_round())
    assert readiness.report().ready
    now[0] += 4.9  # within 3 intervals + 2 s
    assert readiness.report().ready
    now[0] += 0.2
    stale = readiness.report()
    assert not stale.ready
    assert stale.checks["database"] == "last checked 5 s ago"


def test_a_hung_check_fails_its_rounds_and_none_starts_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'treadle.db'}"
    database = Database(url)
    dbschema.upgrade(database)
    readiness = Readiness(make_settings(tmp_path, url), database)
    monkeypatch.setattr(readiness_module, "ROUND_TIMEOUT_SECONDS", 0.1)
    release, started = threading.Event(), []

    def hung() -> dict[str, str]:
        started.append(1)
        release.wait(30)
        return {"database": "ok", "migrations": "ok"}

    monkeypatch.setattr(readiness, "check", hung)

    async def rounds() -> None:
        await readiness.run_round()
        timed_out = readiness.report()
        assert not timed_out.ready
        assert timed_out.checks["database"] == "no answer within 0.1 s"
        await readiness.run_round()
        assert readiness.report().checks["database"] == "the previous check has not finished"
        assert len(started) == 1
        release.set()
        deadline = time.monotonic() + 5
        while not readiness.report().ready and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            await readiness.run_round()
        assert readiness.report().ready
        assert len(started) == 2

    asyncio.run(rounds())


def test_stopping_the_loop_stops_it_even_as_a_round_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The app's shutdown cancels the loop; a round ending at that very moment must not swallow
    the cancellation (the shutdown would wait for the loop forever)."""
    url = f"sqlite:///{tmp_path / 'treadle.db'}"
    database = Database(url)
    dbschema.upgrade(database)
    readiness = Readiness(make_settings(tmp_path, url), database)
    rounds: list[asyncio.Future[dict[str, str]]] = []

    def in_thread(_: object) -> asyncio.Future[dict[str, str]]:
        rounds.append(asyncio.get_running_loop().create_future())
        return rounds[-1]

    monkeypatch.setattr(readiness_module, "_in_thread", in_thread)

    async def stop_as_the_round_ends() -> None:
        loop = asyncio.create_task(readiness.run_periodically())
        while not rounds:
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # the loop now waits for its round
        rounds[0].set_result({"database": "ok", "migrations": "ok"})
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(loop, 5)

    asyncio.run(stop_as_the_round_ends())
