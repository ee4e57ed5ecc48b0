"""The official tinker SDK (0.38.0) against an embedded server: sessions and authentication."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
from sqlalchemy import select

from core.apikeys import revoke_api_key
from core.clock import SystemClock
from core.db import Database
from core.tables import Session
from tests.builders import TenantFactory, tenant_factory
from tests.server import AppFactory, running_server

pytestmark = pytest.mark.e2e


@pytest.fixture
def server(
    tmp_path: Path, app_factory: AppFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, Database, TenantFactory]]:
    monkeypatch.setenv("HOME", str(tmp_path))  # no stored tinker credentials
    app = app_factory()
    state = app.state.treadle
    with running_server(app) as base_url:
        yield base_url, state.database, tenant_factory(state.database, state.settings)


def _session(database: Database, session_id: str) -> Session:
    with database.reader() as db:
        row = db.scalar(select(Session).where(Session.id == session_id))
        assert row is not None
        return row


def test_service_client_creates_heartbeats_and_closes_a_session(
    server: tuple[str, Database, TenantFactory],
) -> None:
    base_url, database, make_tenant = server
    key = make_tenant().key
    client = tinker.ServiceClient(base_url=base_url, api_key=key, user_metadata={"run": "smoke"})
    session_id = client.holder.get_session_id()
    created = _session(database, session_id)
    assert created.status == "active"
    assert created.user_metadata == {"run": "smoke"}
    assert created.sdk_version == tinker.__version__

    deadline = time.monotonic() + 25  # the SDK heartbeats every 10 s
    while _session(database, session_id).last_heartbeat_at <= created.last_heartbeat_at:
        assert time.monotonic() < deadline, "no heartbeat reached the server"
        time.sleep(0.5)

    client.close("success").result(timeout=30)
    finished = _session(database, session_id)
    assert (finished.status, finished.end_reason) == ("finished", "success")


def test_revoked_key_fails_fast_with_an_authentication_error(
    server: tuple[str, Database, TenantFactory],
) -> None:
    base_url, database, make_tenant = server
    tenant = make_tenant()
    with database.transaction() as db:
        revoke_api_key(db, SystemClock(), tenant.key_id)
    started = time.monotonic()
    client = tinker.ServiceClient(base_url=base_url, api_key=tenant.key)
    with pytest.raises(tinker.AuthenticationError, match="revoked"):
        client.holder.get_session_id()
    assert time.monotonic() - started < 30  # an error, not minutes of retries


def test_quota_error_reaches_the_sdk_as_a_permission_error(
    server: tuple[str, Database, TenantFactory],
) -> None:
    base_url, _, make_tenant = server
    key = make_tenant(max_concurrent_sessions=0).key
    client = tinker.ServiceClient(base_url=base_url, api_key=key)
    with pytest.raises(tinker.PermissionDeniedError, match="concurrent session limit"):
        client.holder.get_session_id()
