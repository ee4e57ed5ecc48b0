"""First-run set-up for embedded mode: a default tenant and a key to use it with.

The key is kept in the data directory (mode 0600) so that restarting the embedded server prints
the same key; the database holds only its hash.
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import select

from core import apikeys, tenants
from core.clock import Clock
from core.db import Database
from core.settings import Settings
from core.tables import Tenant

DEFAULT_TENANT = "default"


def ensure_default_key(settings: Settings, database: Database, clock: Clock) -> str:
    path: Path = settings.ensure_data_dir() / "default-api-key"
    secret = settings.secret_bytes()
    with database.transaction() as db:
        if path.exists():
            key = path.read_text().strip()
            if apikeys.is_key_usable(db, secret, key):
                return key
        tenant = db.scalar(select(Tenant).where(Tenant.name == DEFAULT_TENANT))
        if tenant is None:
            tenant = tenants.create_tenant(
                db,
                clock,
                DEFAULT_TENANT,
                max_concurrent_sessions=settings.default_max_concurrent_sessions,
                max_lora_rank=settings.default_max_lora_rank,
            )
        _, key = apikeys.issue_api_key(
            db, clock, secret, tenant, name="embedded default", scope="tenant"
        )
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    tmp.replace(path)
    return key
