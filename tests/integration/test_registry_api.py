"""The registry's HTTP routes on SQLite and PostgreSQL: packages, versions, promotion, aliases,
TTLs and lineage through the app, the wire types they answer with, the refusals' statuses and
messages, and another tenant's objects answering like missing ones."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from core import checkpoints, runs, sessions
from core.clock import FakeClock
from tests import services
from tests.builders import TenantKey, tenant_factory
from tests.server import build_app
from treadle.types import (
    LineageResponse,
    RegistryAliasesResponse,
    RegistryPackage,
    RegistryPackagesResponse,
    RegistryVersion,
    RegistryVersionsResponse,
)

pytestmark = pytest.mark.integration

MODEL = "treadle/tiny-1m"
API = "/api/v1/registry"
_seq = itertools.count()


class Env:
    def __init__(self, client: TestClient, clock: FakeClock) -> None:
        self.client, self.clock = client, clock
        state = client.app.state.treadle  # type: ignore[attr-defined]
        self.state = state
        self.make_tenant = tenant_factory(state.database, state.settings, clock)

    def run_with_saves(self, tenant: TenantKey, names: tuple[str, ...]) -> str:
        """A run of `tenant` that saved a checkpoint per name; returns the run id."""
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
                lora_config={"rank": 4},
                user_metadata=None,
            )
            for name in names:
                self.clock.advance(1)
                checkpoints.register(
                    db,
                    self.clock,
                    run=run,
                    kind="training",
                    name=name,
                    artifact_uri=f"file:///nowhere/{next(_seq)}",
                    size_bytes=3,
                    sha256="cd" * 32,
                    user_metadata={"note": name},
                )
            return run.id

    def call(self, tenant: TenantKey, method: str, path: str, **kwargs: Any) -> Any:
        return self.client.request(method, API + path, headers={"X-API-Key": tenant.key}, **kwargs)


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp(f"registry-{request.param}")
    with _database(request, root) as url:
        clock = FakeClock()
        with TestClient(build_app(root, url, clock=clock)) as client:
            yield Env(client, clock)


def _database(request: pytest.FixtureRequest, root: Path) -> contextlib.AbstractContextManager[str]:
    if request.param == "sqlite":
        return contextlib.nullcontext(f"sqlite:///{root / 'treadle.db'}")
    return services.throwaway_database(request.getfixturevalue("postgres_admin_url"))


def test_packages_through_the_api(env: Env) -> None:
    tenant = env.make_tenant()
    created = env.call(
        tenant,
        "POST",
        "/packages",
        json={"name": "chat", "description": "assistant", "tags": ["rl"], "base_model": MODEL},
    )
    assert created.status_code == 200, created.text
    assert RegistryPackage.model_validate(created.json()).version_count == 0
    taken = env.call(tenant, "POST", "/packages", json={"name": "chat", "base_model": MODEL})
    assert taken.status_code == 422 and "is taken" in taken.json()["detail"]
    bad = env.call(tenant, "POST", "/packages", json={"name": "-x", "base_model": MODEL})
    assert bad.status_code == 422
    patched = env.call(tenant, "PATCH", "/packages/chat", json={"name": "chat-v2", "tags": []})
    assert patched.status_code == 200, patched.text
    assert (patched.json()["name"], patched.json()["tags"]) == ("chat-v2", [])
    assert patched.json()["description"] == "assistant"
    listing = RegistryPackagesResponse.model_validate(
        env.call(tenant, "GET", "/packages", params={"limit": 10}).json()
    )
    assert [p.name for p in listing.packages] == ["chat-v2"]
    assert env.call(tenant, "GET", "/packages/chat").status_code == 404
    assert env.call(tenant, "DELETE", "/packages/chat-v2").status_code == 204
    assert env.call(tenant, "GET", "/packages/chat-v2").status_code == 404


def test_versions_promotion_aliases_and_lineage(env: Env) -> None:
    tenant = env.make_tenant()
    run = env.run_with_saves(tenant, ("a", "b"))
    versions = RegistryVersionsResponse.model_validate(
        env.call(tenant, "GET", f"/packages/{run}/versions").json()
    )
    assert [v.version for v in versions.versions] == [2, 1]  # newest first
    newest = versions.versions[0]
    assert newest.tinker_path == f"tinker://{run}/weights/b"
    assert (newest.package, newest.training_run_id, newest.aliases) == (run, run, ["latest"])
    assert (newest.lora_config, newest.user_metadata) == ({"rank": 4}, {"note": "b"})

    env.call(tenant, "POST", "/packages", json={"name": "prod", "base_model": MODEL})
    promoted = env.call(
        tenant, "POST", f"/packages/{run}/versions/1/promote", json={"target_package": "prod"}
    )
    assert promoted.status_code == 200, promoted.text
    copy = RegistryVersion.model_validate(promoted.json())
    assert (copy.package, copy.version, copy.source_version, copy.tinker_path) == (
        "prod",
        1,
        f"{run}:1",
        None,
    )
    alias = env.call(tenant, "PUT", "/packages/prod/aliases/production", json={"version": 1})
    assert alias.status_code == 200, alias.text
    latest = env.call(tenant, "PUT", "/packages/prod/aliases/latest", json={"version": 1})
    assert latest.status_code == 422 and "kept by the registry" in latest.json()["detail"]
    aliases = RegistryAliasesResponse.model_validate(
        env.call(tenant, "GET", "/packages/prod/aliases").json()
    )
    assert [(a.name, a.version, a.virtual) for a in aliases.aliases] == [
        ("latest", 1, True),
        ("production", 1, False),
    ]
    shown = RegistryVersion.model_validate(
        env.call(tenant, "GET", "/packages/prod/versions/1").json()
    )
    assert shown.aliases == ["latest", "production"]

    refused = env.call(tenant, "DELETE", "/packages/prod/versions/1")
    assert refused.status_code == 422 and "prod@production" in refused.json()["detail"]
    in_use = env.call(tenant, "DELETE", "/packages/prod")
    assert in_use.status_code == 422 and "production" in in_use.json()["detail"]

    ttl = env.call(tenant, "PUT", f"/packages/{run}/versions/2/ttl", json={"ttl_seconds": 7200})
    assert ttl.status_code == 200 and ttl.json()["expires_at"] is not None
    assert env.call(tenant, "DELETE", f"/packages/{run}/versions/2").status_code == 204
    assert env.call(tenant, "GET", f"/packages/{run}/versions/2").status_code == 404
    deleted = env.call(tenant, "GET", f"/packages/{run}/versions", params={"status": "deleted"})
    assert [v["version"] for v in deleted.json()["versions"]] == [2]

    graph = LineageResponse.model_validate(env.call(tenant, "GET", "/packages/prod/lineage").json())
    assert {(e.relation, e.source.split(":")[0], e.target.split(":")[0]) for e in graph.edges} == {
        ("saved", "run", "version"),
        ("promoted", "version", "version"),
    }
    labels = {n.label for n in graph.nodes}
    assert {run, f"{run}:1", "prod:1"} <= labels

    audit = env.client.get("/api/v1/audit", headers={"X-API-Key": tenant.key}).json()
    assert "registry_alias_created" in [e["event"] for e in audit["entries"]]


def test_another_tenants_registry_answers_like_a_missing_one(env: Env) -> None:
    owner, stranger = env.make_tenant(), env.make_tenant()
    run = env.run_with_saves(owner, ("a",))
    env.call(owner, "PUT", f"/packages/{run}/aliases/prod", json={"version": 1})
    made_up = "nobody:train:0"
    for method, suffix, body in [
        ("GET", "", None),
        ("PATCH", "", {"description": "x"}),
        ("DELETE", "", None),
        ("GET", "/versions", None),
        ("GET", "/versions/1", None),
        ("DELETE", "/versions/1", None),
        ("PUT", "/versions/1/ttl", {"ttl_seconds": 7200}),
        ("POST", "/versions/1/promote", {"target_package": "x"}),
        ("GET", "/aliases", None),
        ("PUT", "/aliases/prod", {"version": 1}),
        ("DELETE", "/aliases/prod", None),
        ("GET", "/lineage", None),
    ]:
        theirs = env.call(stranger, method, f"/packages/{run}{suffix}", json=body)
        missing = env.call(stranger, method, f"/packages/{made_up}{suffix}", json=body)
        assert theirs.status_code == missing.status_code == 404, (method, suffix)
        assert theirs.json()["detail"].replace(run, made_up) == missing.json()["detail"]
    stranger_pkg = env.call(stranger, "POST", "/packages", json={"name": "s", "base_model": MODEL})
    assert stranger_pkg.status_code == 200
    into_foreign = env.call(
        stranger, "POST", "/packages/s/versions/1/promote", json={"target_package": run}
    )
    assert into_foreign.status_code == 404
    assert env.call(owner, "GET", f"/packages/{run}/aliases").json()["aliases"][1]["name"] == "prod"
