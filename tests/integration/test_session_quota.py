"""The concurrent-session quota holds under concurrent requests (PostgreSQL row lock)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.builders import tenant_factory
from tests.server import AppFactory, running_server

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
def test_fifty_concurrent_creates_respect_a_limit_of_three(
    app_factory: AppFactory, backend: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("postgres_url" if backend == "postgres" else "sqlite_url")
    app = app_factory(url)
    state = app.state.treadle
    tenant = tenant_factory(state.database, state.settings)(max_concurrent_sessions=3)
    headers = {"X-API-Key": tenant.key}

    with running_server(app) as base_url:

        def create(_: int) -> httpx.Response:
            with httpx.Client(base_url=base_url, timeout=60) as client:
                return client.post("/api/v1/create_session", json={"tags": []}, headers=headers)

        with ThreadPoolExecutor(max_workers=50) as pool:
            responses = list(pool.map(create, range(50)))

        ok = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code == 403]
        assert len(ok) == 3, [r.text for r in responses if r.status_code not in (200, 403)]
        assert len(refused) == 47
        message = refused[0].json()["detail"]
        assert "allows 3 open sessions and 3 are open" in message
        assert refused[0].headers["x-should-retry"] == "false"

        with httpx.Client(base_url=base_url, headers=headers) as client:
            for response in ok:
                session_id = response.json()["session_id"]
                finish = client.post(
                    f"/api/v1/sessions/{session_id}/finish", json={"reason": {"type": "success"}}
                )
                assert finish.status_code == 200
            again = [client.post("/api/v1/create_session", json={}) for _ in range(4)]
        assert [r.status_code for r in again] == [200, 200, 200, 403]
