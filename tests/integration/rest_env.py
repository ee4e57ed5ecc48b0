"""What the REST tests share: an app on SQLite or PostgreSQL with a fake clock, and versions
seeded through the core services (see tests/integration/test_rest_api.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from core import checkpoints, runs, sessions
from core.clock import FakeClock
from core.tables import ModelVersion
from tests import services
from tests.builders import TenantFactory, TenantKey, tenant_factory
from tests.server import build_app

MODEL = "treadle/tiny-1m"
FILES = {"adapter_config.json": b'{"r": 4}', "nested/adapter_model.safetensors": b"\x00\x01weights"}
_seq = itertools.count()


@dataclasses.dataclass
class Env:
    client: TestClient
    clock: FakeClock
    make_tenant: TenantFactory
    root: Path

    @property
    def state(self) -> Any:
        return self.client.app.state.treadle  # type: ignore[attr-defined]

    def seed(
        self,
        tenant: TenantKey,
        names: tuple[tuple[str, str], ...] = (("training", "a"), ("adapter", "c")),
        user_metadata: dict[str, Any] | None = None,
        ttl_seconds: int | None = None,
    ) -> str:
        """A run of `tenant` with a checkpoint per (kind, name); returns the run id."""
        with self.state.database.transaction() as db:
            session = sessions.create_session(
                db, self.clock, tenant_id=tenant.tenant_id, api_key_id=None, ttl_seconds=3600
            )
            run, _ = runs.create_training_run(
                db,
                self.clock,
                tenant_id=tenant.tenant_id,
                session_id=session.id,
                model_seq_id=0,
                base_model=MODEL,
                lora_config={"rank": 4, "train_mlp": False},
                user_metadata=user_metadata,
            )
            for kind, name in names:
                key = f"{tenant.tenant_id}/{next(_seq)}"
                folder = self.state.store.local_dir(key)
                for relpath, data in FILES.items():
                    (folder / relpath).parent.mkdir(parents=True, exist_ok=True)
                    (folder / relpath).write_bytes(data)
                uri = self.state.store.publish(key)
                size, digest = self.state.store.size_and_digest(uri)
                checkpoints.register(
                    db,
                    self.clock,
                    run=run,
                    kind=kind,
                    name=name,
                    artifact_uri=uri,
                    size_bytes=size,
                    sha256=digest,
                    ttl_seconds=ttl_seconds,
                )
            return run.id

    def versions(self) -> list[tuple[Any, ...]]:
        with self.state.database.reader() as db:
            rows = db.scalars(select(ModelVersion).order_by(ModelVersion.id))
            return [
                (r.id, r.status, r.tinker_path, r.public, r.expires_at, r.artifact_uri)
                for r in rows
            ]


def open_env(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Env]:
    """The body of an `env` fixture parametrized with "sqlite" and "postgres"."""
    root = tmp_path_factory.mktemp(f"rest-{request.param}")
    with _database(request, root) as url:
        clock = FakeClock()
        app = build_app(root, url, clock=clock)
        state = app.state.treadle
        with TestClient(app) as client:
            yield Env(client, clock, tenant_factory(state.database, state.settings, clock), root)


def _database(request: pytest.FixtureRequest, root: Path) -> contextlib.AbstractContextManager[str]:
    if request.param == "sqlite":
        return contextlib.nullcontext(f"sqlite:///{root / 'treadle.db'}")
    return services.throwaway_database(request.getfixturevalue("postgres_admin_url"))


def headers(tenant: TenantKey) -> dict[str, str]:
    return {"X-API-Key": tenant.key}
