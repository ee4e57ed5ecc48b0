"""Settings and tenants for tests, built the way the product builds them (no fixtures here:
fixtures live in conftest.py files and use these)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from sqlalchemy import insert

from billing.rollups import RolledEvent, add_to_rollups
from billing.spend import add_spend
from billing.tables import UsageEvent
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


def record(
    database: Database,
    key: TenantKey,
    hour: datetime,
    *,
    kind: str = "training",
    model: str = "m/a",
    quantity: int,
    amount_micros: int,
    price_id: int | None = None,
) -> None:
    """One usage event costing `amount_micros` in the ledger, its rollup and its period's
    spend, as `billing.ledger.record_usage` writes them (without an operation row behind it);
    under price version `price_id` when given (the Stripe pusher sends priced usage only)."""
    with database.transaction() as db:
        db.execute(
            insert(UsageEvent),
            {
                "tenant_id": key.tenant_id,
                "api_key_id": key.key_id,
                "kind": kind,
                "base_model": model,
                "quantity": quantity,
                "cached_quantity": 0,
                "amount_micros": amount_micros,
                "price_id": price_id,
                "hour": hour,
                "created_at": hour,
            },
        )
        event = RolledEvent(
            key.tenant_id, hour, key.key_id, None, model, kind, price_id, quantity, 0, amount_micros
        )
        add_to_rollups(db, [event])
        add_spend(db, key.tenant_id, hour, amount_micros)
