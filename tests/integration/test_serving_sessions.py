"""Serving sessions (`core.sessions.serving_session`, one per API key, in which /oai/v1 samples
what a request names without a sampling session of its own) on SQLite and PostgreSQL: they never
count against the tenant's concurrent-session quota, nor does the quota keep one from opening;
they expire after the TTL without use like any session, lazily and by the sweep, and the key's
next request opens a fresh one."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from core import sessions
from core.clock import FakeClock
from core.db import Database
from core.errors import QuotaExceeded, SessionExpired
from core.tables import Session, SessionKind, SessionStatus
from tests.builders import TenantFactory, TenantKey, make_settings, tenant_factory

pytestmark = pytest.mark.integration

TTL = 300.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_tenant(migrated: Database, clock: FakeClock, tmp_path: Path) -> TenantFactory:
    return tenant_factory(migrated, make_settings(tmp_path, migrated.url), clock)


@pytest.fixture
def tenant(make_tenant: TenantFactory) -> TenantKey:
    return make_tenant(max_concurrent_sessions=1)


def _serving(database: Database, clock: FakeClock, tenant: TenantKey) -> str:
    with database.transaction() as db:
        return sessions.serving_session(
            db, clock, tenant_id=tenant.tenant_id, api_key_id=tenant.key_id, ttl_seconds=TTL
        ).id


def _client(database: Database, clock: FakeClock, tenant: TenantKey) -> str:
    with database.transaction() as db:
        return sessions.create_session(
            db, clock, tenant_id=tenant.tenant_id, api_key_id=tenant.key_id, ttl_seconds=TTL
        ).id


def _status(database: Database, session_id: str) -> tuple[SessionStatus, str | None]:
    with database.reader() as db:
        row = db.execute(
            select(Session.status, Session.end_reason).where(Session.id == session_id)
        ).one()
    return row.status, row.end_reason


def test_serving_sessions_do_not_count_against_the_quota(
    migrated: Database, clock: FakeClock, tenant: TenantKey
) -> None:
    # The quota is full: a serving session still opens, and opening it takes no slot.
    client = _client(migrated, clock, tenant)
    serving = _serving(migrated, clock, tenant)
    assert serving != client
    quota_full = pytest.raises(QuotaExceeded, match="allows 1 open sessions and 1 are open")
    with migrated.transaction() as db, quota_full:
        sessions.create_session(
            db, clock, tenant_id=tenant.tenant_id, api_key_id=tenant.key_id, ttl_seconds=TTL
        )
    # The key's later requests share it.
    assert _serving(migrated, clock, tenant) == serving
    with migrated.reader() as db:
        kinds = {row.id: row.kind for row in db.execute(select(Session.id, Session.kind))}
    assert kinds == {client: SessionKind.CLIENT, serving: SessionKind.SERVING}
    # The client session ending frees its slot; the serving session, still open, takes none.
    with migrated.transaction() as db:
        sessions.finish(
            db,
            clock,
            tenant_id=tenant.tenant_id,
            session_id=client,
            reason="success",
            detail=None,
            ttl_seconds=TTL,
        )
    assert _client(migrated, clock, tenant) not in (client, serving)
    assert _status(migrated, serving) == (SessionStatus.ACTIVE, None)


def test_a_used_serving_session_stays_and_an_unused_one_expires(
    migrated: Database, clock: FakeClock, tenant: TenantKey
) -> None:
    serving = _serving(migrated, clock, tenant)
    clock.advance(TTL - 1)
    assert _serving(migrated, clock, tenant) == serving  # each use is a heartbeat
    clock.advance(TTL - 1)
    with migrated.transaction() as db:
        assert sessions.expire_idle(db, clock, TTL) == []
    clock.advance(2)
    with migrated.transaction() as db:
        assert sessions.expire_idle(db, clock, TTL) == [serving]
    assert _status(migrated, serving) == (SessionStatus.EXPIRED, "heartbeat_timeout")
    with migrated.transaction() as db:
        ended = sessions.heartbeat(
            db, clock, tenant_id=tenant.tenant_id, session_id=serving, ttl_seconds=TTL
        )
        with pytest.raises(SessionExpired):
            sessions.require_open(ended)
    fresh = _serving(migrated, clock, tenant)
    assert fresh != serving
    assert _status(migrated, fresh) == (SessionStatus.ACTIVE, None)


def test_an_expired_serving_session_is_replaced_without_the_sweep(
    migrated: Database, clock: FakeClock, tenant: TenantKey, make_tenant: TenantFactory
) -> None:
    serving = _serving(migrated, clock, tenant)
    clock.advance(TTL + 1)
    fresh = _serving(migrated, clock, tenant)
    assert fresh != serving
    assert _status(migrated, serving) == (SessionStatus.EXPIRED, "heartbeat_timeout")
    # Each API key has its own.
    other_key = make_tenant()
    assert _serving(migrated, clock, other_key) not in (serving, fresh)
