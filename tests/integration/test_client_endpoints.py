"""Client bootstrap endpoints and request limits."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.builders import TenantFactory, tenant_factory
from tests.server import AppFactory

pytestmark = pytest.mark.integration


@pytest.fixture
def env(app_factory: AppFactory) -> Iterator[tuple[TestClient, TenantFactory]]:
    app = app_factory(
        max_request_bytes=4096,
        telemetry_per_minute=4,
        models=["treadle/tiny-1m", "Qwen/Qwen3-8B"],
    )
    state = app.state.treadle
    with TestClient(app) as client:
        yield client, tenant_factory(state.database, state.settings)


def test_client_config_and_health(env: tuple[TestClient, TenantFactory]) -> None:
    client, _ = env
    assert client.post("/api/v1/client/config", json={"sdk_version": "0.38.0"}).json() == {
        "use_pyqwest_transport": False,
        "billing_exception_max_pause_duration_sec": 3600,
    }
    assert client.post("/api/v1/client/dynamic_config", json={"sdk_version": "0.38.0"}).json() == {}
    assert client.get("/api/v1/healthz").json() == {"status": "ok"}


def test_capabilities_list_the_catalog(env: tuple[TestClient, TenantFactory]) -> None:
    client, make_tenant = env
    key = make_tenant().key
    body = client.get("/api/v1/get_server_capabilities", headers={"X-API-Key": key}).json()
    assert [m["model_name"] for m in body["supported_models"]] == [
        "treadle/tiny-1m",
        "Qwen/Qwen3-8B",
    ]


def test_telemetry_is_accepted_and_rate_limited(env: tuple[TestClient, TenantFactory]) -> None:
    client, make_tenant = env
    headers = {"X-API-Key": make_tenant().key}
    statuses = [
        client.post("/api/v1/telemetry", json={"events": []}, headers=headers).status_code
        for _ in range(3)
    ]
    assert statuses[0] == 200
    limited = [
        client.post("/api/v1/telemetry", json={"events": []}, headers=headers) for _ in range(3)
    ]
    assert limited[-1].status_code == 429
    assert "per minute" in limited[-1].json()["detail"]
    assert int(limited[-1].headers["Retry-After"]) >= 1


def test_oversized_body_gets_413(env: tuple[TestClient, TenantFactory]) -> None:
    client, make_tenant = env
    key = make_tenant().key
    response = client.post(
        "/api/v1/create_session",
        content=b"{" + b" " * 10_000 + b"}",
        headers={"X-API-Key": key, "Content-Type": "application/json"},
    )
    assert response.status_code == 413
    assert "4096 bytes" in response.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while streaming
        yield b'{"tags": ["'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"]}'

    streamed = client.post(
        "/api/v1/create_session",
        content=chunks(),
        headers={"X-API-Key": key, "Content-Type": "application/json"},
    )
    assert streamed.status_code == 413
    assert client.get("/api/v1/sessions", headers={"X-API-Key": key}).json() == {"sessions": []}
