"""First-run set-up for embedded mode: a default tenant and a key to use it with.

The key is kept in the data directory (mode 0600, like the server secret beside it) so that a
restarted embedded server keeps working with the same key; the database holds only its hash.
The key is shown once, when it is made; afterwards only where it is kept.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from sqlalchemy import select

from core import apikeys, tenants
from core.clock import Clock
from core.db import Database
from core.settings import Settings
from core.tables import Tenant

DEFAULT_TENANT = "default"
KEY_FILE = "default-api-key"


@dataclasses.dataclass(frozen=True)
class DefaultKey:
    key: str
    path: Path
    """The file that keeps it (readable by its owner only)."""
    created: bool
    """Made just now (first start, or the kept one was unusable): show it once."""


def default_key(settings: Settings, database: Database, clock: Clock) -> DefaultKey:
    """The default tenant's key from the data directory, made (with the tenant) if missing."""
    path: Path = settings.ensure_data_dir() / KEY_FILE
    secret = settings.secret_bytes()
    with database.transaction() as db:
        if path.exists():
            key = path.read_text().strip()
            if apikeys.is_key_usable(db, secret, key):
                return DefaultKey(key, path, created=False)
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
    tmp.unlink(missing_ok=True)  # a leftover could have looser permissions than 0600
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    tmp.replace(path)
    return DefaultKey(key, path, created=True)


def ensure_default_key(settings: Settings, database: Database, clock: Clock) -> str:
    """The default tenant's key (see `default_key`)."""
    return default_key(settings, database, clock).key
