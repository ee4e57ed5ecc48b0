"""`TREADLE_ALLOWED_HOSTS`: requests addressed to any other host are refused before a route
runs, so the download URLs built from the `Host` header only ever name listed hosts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from core import checkpoints, runs, sessions
from core.clock import FakeClock
from core.db import Database
from core.settings import Settings
from core.tables import Session as SessionRow
from tests.builders import TenantKey, tenant_factory
from tests.server import AppFactory

pytestmark = pytest.mark.integration


def test_the_setting_reads_a_comma_separated_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_ALLOWED_HOSTS", " api.example.com, *.internal ,,")
    assert Settings().allowed_hosts == ["api.example.com", "*.internal"]
    monkeypatch.setenv("TREADLE_ALLOWED_HOSTS", "")
    assert Settings().allowed_hosts is None


@pytest.fixture
def served(
    app_factory: AppFactory, database_url: str
) -> Iterator[tuple[TestClient, TenantKey, str]]:
    clock = FakeClock()
    app = app_factory(database_url, clock=clock, allowed_hosts=["API.example.com", "*.internal"])
    with TestClient(app, base_url="http://api.example.com") as client:
        state = app.state.treadle
        tenant = tenant_factory(state.database, state.settings, clock)()
        with state.database.transaction() as db:
            session = sessions.create_session(
                db, clock, tenant_id=tenant.tenant_id, api_key_id=None, ttl_seconds=1e6
            )
        with state.database.transaction() as db:
            run, _ = runs.create_training_run(
                db,
                clock,
                tenant_id=tenant.tenant_id,
                session_id=session.id,
                model_seq_id=0,
                base_model="treadle/tiny-1m",
                lora_config={"rank": 4},
                user_metadata=None,
            )
            folder = state.store.local_dir(f"{tenant.tenant_id}/export")
            (folder / "adapter_config.json").write_text('{"r": 4}')
            uri = state.store.uri(f"{tenant.tenant_id}/export")
            size, digest = state.store.size_and_digest(uri)
            checkpoints.register(
                db,
                clock,
                run=run,
                kind="adapter",
                name="c",
                artifact_uri=uri,
                size_bytes=size,
                sha256=digest,
            )
            run_id = run.id
        yield client, tenant, run_id


def _sessions(client: TestClient) -> int:
    database: Database = client.app.state.treadle.database  # type: ignore[attr-defined]
    with database.reader() as db:
        return db.scalar(select(func.count()).select_from(SessionRow)) or 0


def test_requests_for_other_hosts_are_refused_before_any_route_runs(
    served: tuple[TestClient, TenantKey, str],
) -> None:
    client, tenant, run_id = served
    key = {"X-API-Key": tenant.key}
    urls = f"/api/v1/training_runs/{run_id}/checkpoints/external_weights/c/external_weights_urls"
    before = _sessions(client)
    for host in ("evil.example", "api.example.com.evil.example", "internal", "", "x" * 5000):
        headers = {**key, "Host": host}
        for response in (
            client.post("/api/v1/create_session", json={}, headers=headers),
            client.get(urls, headers=headers),
            client.get("/api/v1/healthz", headers=headers),
        ):
            assert response.status_code == 400, (host[:40], response.text)
            body = response.json()
            assert body["category"] == "user" and response.headers["x-should-retry"] == "false"
            assert "api.example.com, *.internal" in body["detail"]
            assert len(response.content) < 1000
    assert _sessions(client) == before

    for host in ("api.example.com", "API.Example.com:8443", "node-1.internal", "a.b.internal:80"):
        assert client.get("/api/v1/healthz", headers={"Host": host}).status_code == 200
    fetched = client.get(urls, headers=key)
    assert fetched.status_code == 200, fetched.text
    assert all(
        url.startswith("http://api.example.com/api/v1/artifacts/")
        for url in fetched.json()["urls"].values()
    )
