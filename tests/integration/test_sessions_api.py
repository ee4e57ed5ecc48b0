"""Session lifecycle over HTTP, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from core.clock import FakeClock
from tests.builders import TenantFactory, tenant_factory
from tests.server import AppFactory

pytestmark = pytest.mark.integration

TTL = 300.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def env(
    app_factory: AppFactory, database_url: str, clock: FakeClock
) -> Iterator[tuple[TestClient, TenantFactory]]:
    app = app_factory(database_url, clock=clock, session_ttl_seconds=TTL)
    state = app.state.treadle
    with TestClient(app) as client:
        yield client, tenant_factory(state.database, state.settings, clock)


def _create(client: TestClient, key: str) -> str:
    response = client.post(
        "/api/v1/create_session",
        json={"tags": [], "type": "create_session"},
        headers={"X-API-Key": key},
    )
    assert response.status_code == 200, response.text
    session_id: str = response.json()["session_id"]
    return session_id


def _heartbeat(client: TestClient, key: str, session_id: str) -> int:
    return client.post(
        "/api/v1/session_heartbeat",
        json={"session_id": session_id, "type": "session_heartbeat"},
        headers={"X-API-Key": key},
    ).status_code


def test_session_lifecycle(env: tuple[TestClient, TenantFactory]) -> None:
    client, make_tenant = env
    key = make_tenant().key
    session_id = _create(client, key)
    assert _heartbeat(client, key, session_id) == 200
    finished = client.post(
        f"/api/v1/sessions/{session_id}/finish",
        json={"reason": {"type": "success"}},
        headers={"X-API-Key": key},
    )
    assert finished.status_code == 200
    assert finished.json()["status"] == "finished"
    assert _heartbeat(client, key, session_id) == 410
    # Finishing twice is harmless and keeps the first outcome.
    again = client.post(
        f"/api/v1/sessions/{session_id}/finish",
        json={"reason": {"type": "errored"}},
        headers={"X-API-Key": key},
    )
    assert again.json()["status"] == "finished"
    listed = client.get("/api/v1/sessions", headers={"X-API-Key": key}).json()
    assert listed == {"sessions": [session_id]}


def test_idle_session_expires_and_frees_its_slot(
    env: tuple[TestClient, TenantFactory], clock: FakeClock
) -> None:
    client, make_tenant = env
    key = make_tenant(max_concurrent_sessions=1).key
    first = _create(client, key)
    blocked = client.post("/api/v1/create_session", json={}, headers={"X-API-Key": key})
    assert blocked.status_code == 403
    clock.advance(TTL - 1)
    assert _heartbeat(client, key, first) == 200  # a heartbeat keeps it alive
    clock.advance(TTL + 1)
    second = _create(client, key)  # the silent session expired and freed the slot
    assert _heartbeat(client, key, first) == 410
    assert _heartbeat(client, key, second) == 200
    detail = client.get(f"/api/v1/sessions/{first}", headers={"X-API-Key": key}).json()
    assert detail["status"] == "expired"


def test_expiry_sweep_marks_silent_sessions(
    env: tuple[TestClient, TenantFactory], clock: FakeClock
) -> None:
    from core.sessions import expire_idle

    client, make_tenant = env
    key = make_tenant().key
    session_id = _create(client, key)
    database = client.app.state.treadle.database  # type: ignore[attr-defined]
    with database.transaction() as db:
        assert expire_idle(db, clock, TTL) == []
    clock.advance(TTL + 5)
    with database.transaction() as db:
        assert expire_idle(db, clock, TTL) == [session_id]
    assert _heartbeat(client, key, session_id) == 410


def test_foreign_session_is_not_found_everywhere(env: tuple[TestClient, TenantFactory]) -> None:
    client, make_tenant = env
    owner, other = make_tenant(), make_tenant()
    session_id = _create(client, owner.key)
    foreign = {"X-API-Key": other.key}
    calls = [
        client.post("/api/v1/session_heartbeat", json={"session_id": session_id}, headers=foreign),
        client.post(
            f"/api/v1/sessions/{session_id}/finish",
            json={"reason": {"type": "success"}},
            headers=foreign,
        ),
        client.get(f"/api/v1/sessions/{session_id}", headers=foreign),
    ]
    for response in calls:
        assert response.status_code == 404, response.text
        assert "not found" in response.json()["detail"]
    assert client.get("/api/v1/sessions", headers=foreign).json() == {"sessions": []}
    # ...and the owner's session is untouched by those attempts.
    assert _heartbeat(client, owner.key, session_id) == 200


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        (None, "missing API key"),
        ("not-a-key", "malformed"),
        ("tml-0123456789ab-" + "x" * 43, "unknown API key"),
    ],
)
def test_bad_keys_get_401_with_json(
    env: tuple[TestClient, TenantFactory], header: str | None, fragment: str
) -> None:
    client, _ = env
    headers = {} if header is None else {"X-API-Key": header}
    response = client.post("/api/v1/create_session", json={}, headers=headers)
    assert response.status_code == 401
    assert fragment in response.json()["detail"]


def test_revoked_key_gets_401(env: tuple[TestClient, TenantFactory]) -> None:
    from core.apikeys import revoke_api_key

    client, make_tenant = env
    tenant = make_tenant()
    session_id = _create(client, tenant.key)
    database = client.app.state.treadle.database  # type: ignore[attr-defined]
    with database.transaction() as db:
        revoke_api_key(db, FakeClock(), tenant.key_id)
    response = client.post(
        "/api/v1/session_heartbeat",
        json={"session_id": session_id},
        headers={"X-API-Key": tenant.key},
    )
    assert response.status_code == 401
    assert "revoked" in response.json()["detail"]


def test_unknown_fields_are_rejected_with_a_clear_message(
    env: tuple[TestClient, TenantFactory],
) -> None:
    client, make_tenant = env
    key = make_tenant().key
    response = client.post(
        "/api/v1/create_session", json={"tagz": ["x"]}, headers={"X-API-Key": key}
    )
    assert response.status_code == 422
    assert "tagz" in response.json()["detail"]
    assert client.get("/api/v1/sessions", headers={"X-API-Key": key}).json() == {"sessions": []}
