"""Shared fixtures: real databases, settings, tenants with keys, running servers."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

from api import dbschema
from core import apikeys, tenants
from core.clock import Clock, SystemClock
from core.db import Database
from core.settings import Settings
from tests import services


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


def make_settings(tmp_path: Path, database_url: str, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "data_dir": tmp_path / "data",
        "database_url": database_url,
        "server_secret": "test-secret-0123456789abcdef",
        "expiry_sweep_seconds": 3600.0,
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


@pytest.fixture
def migrated(database_url: str) -> Database:
    database = Database(database_url)
    dbschema.upgrade(database)
    return database


@dataclasses.dataclass
class TenantKey:
    tenant_id: str
    tenant_name: str
    key_id: str
    key: str


TenantFactory = Callable[..., TenantKey]


def tenant_factory(
    database: Database, settings: Settings, clock: Clock | None = None
) -> TenantFactory:
    clock = clock or SystemClock()
    counter = iter(range(1_000_000))

    def create(
        name: str | None = None,
        *,
        max_concurrent_sessions: int = 10,
        max_lora_rank: int = 64,
        scope: str = "tenant",
    ) -> TenantKey:
        with database.transaction() as db:
            tenant = tenants.create_tenant(
                db,
                clock,
                name or f"tenant-{next(counter)}",
                max_concurrent_sessions=max_concurrent_sessions,
                max_lora_rank=max_lora_rank,
            )
            row, key = apikeys.issue_api_key(
                db, clock, settings.secret_bytes(), tenant, name="test", scope=scope
            )
            return TenantKey(tenant.id, tenant.name, row.id, key)

    return create
