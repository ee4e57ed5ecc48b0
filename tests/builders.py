"""Settings and tenants for tests, built the way the product builds them (no fixtures here:
fixtures live in conftest.py files and use these)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from core import apikeys, tenants
from core.clock import Clock, SystemClock
from core.db import Database
from core.settings import Settings


def make_settings(tmp_path: Path, database_url: str, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "data_dir": tmp_path / "data",
        "database_url": database_url,
        "server_secret": "test-secret-0123456789abcdef",
        "expiry_sweep_seconds": 3600.0,
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


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
