"""Sampling from saved weights is authorised on every request, on the worker too.

The API checks access when it accepts a sample; these tests cover what happens after: a sample
accepted while its checkpoint was readable fails with a user error on the worker once the
checkpoint is unpublished, deleted or expired — also when the worker already holds the weights —
and the worker drops weights that no open session may sample any more. The engine is stepped
by the test (the app runs without its engine thread), so each sample is queued before access
changes and executed after, on every run.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any, Protocol

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from billing.tables import UsageEvent
from core.clock import FakeClock
from core.db import Database
from core.tables import ModelVersion, Operation
from scheduler.worker.host import WorkerHost, build_engine
from tests.builders import tenant_factory
from tests.server import AppFactory

pytestmark = pytest.mark.integration

MODEL = "treadle/tiny-1m"
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}


class Reply(Protocol):
    """What the tests read of an HTTP response (the test client's response type)."""

    @property
    def status_code(self) -> int: ...

    @property
    def text(self) -> str: ...

    def json(self) -> Any: ...


@dataclasses.dataclass
class Tenant:
    headers: dict[str, str]
    session_id: str
    samplers: itertools.count[int] = dataclasses.field(default_factory=itertools.count)


@dataclasses.dataclass
class World:
    client: TestClient
    host: WorkerHost
    clock: FakeClock
    database: Database
    owner: Tenant
    other: Tenant
    run_id: str
    seqs: itertools.count[int] = dataclasses.field(default_factory=lambda: itertools.count(1))

    def post(self, tenant: Tenant, route: str, body: dict[str, Any]) -> Reply:
        return self.client.post(f"/api/v1/{route}", json=body, headers=tenant.headers)

    def submit(self, tenant: Tenant, route: str, body: dict[str, Any]) -> str:
        response = self.post(tenant, route, body)
        assert response.status_code == 200, response.text
        return str(response.json()["request_id"])

    def future(self, tenant: Tenant, request_id: str) -> dict[str, Any]:
        """The finished op's body; the test has drained the engine, so it never waits."""
        body: dict[str, Any] = self.post(
            tenant, "retrieve_future", {"request_id": request_id}
        ).json()
        assert body.get("type") != "try_again", body
        return body

    def run_op(self, tenant: Tenant, route: str, body: dict[str, Any]) -> dict[str, Any]:
        request_id = self.submit(tenant, route, body)
        self.host.drain()
        result = self.future(tenant, request_id)
        assert "error" not in result, result
        return result

    def save_for_sampler(self, name: str, **extra: Any) -> str:
        body = {"model_id": self.run_id, "path": name, "seq_id": next(self.seqs), **extra}
        return str(self.run_op(self.owner, "save_weights_for_sampler", body)["path"])

    def checkpoint(self, path: str, action: str) -> None:
        route = f"/api/v1/training_runs/{self.run_id}/checkpoints/sampler_weights/"
        route += path.rsplit("/", 1)[1]
        method, suffix = {
            "publish": ("POST", "/publish"),
            "unpublish": ("DELETE", "/publish"),
            "delete": ("DELETE", ""),
        }[action]
        response = self.client.request(method, route + suffix, headers=self.owner.headers)
        assert response.status_code == 204, response.text

    def sampler(self, tenant: Tenant, **source: str) -> str:
        response = self.post(
            tenant,
            "create_sampling_session",
            {
                "session_id": tenant.session_id,
                "sampling_session_seq_id": next(tenant.samplers),
                **source,
            },
        )
        assert response.status_code == 200, response.text
        return str(response.json()["sampling_session_id"])

    def sample(self, tenant: Tenant, sampler_id: str) -> Reply:
        """Submit one sample request; the engine does not run it until the test drains."""
        return self.post(
            tenant,
            "asample",
            {
                "sampling_session_id": sampler_id,
                "seq_id": next(self.seqs),
                "num_samples": 1,
                "prompt": PROMPT,
                "sampling_params": {"max_tokens": 2, "seed": 1},
            },
        )

    def queued_sample(self, tenant: Tenant, sampler_id: str) -> str:
        response = self.sample(tenant, sampler_id)
        assert response.status_code == 200, response.text
        return str(response.json()["request_id"])

    def sampled(self, tenant: Tenant, sampler_id: str) -> None:
        request_id = self.queued_sample(tenant, sampler_id)
        self.host.drain()
        result = self.future(tenant, request_id)
        assert len(result["sequences"]) == 1, result

    def weights_run(self, path: str) -> str:
        with self.database.reader() as db:
            version_id = db.scalar(select(ModelVersion.id).where(ModelVersion.tinker_path == path))
        assert version_id is not None
        return f"sampler:{version_id}"

    def usage_of(self, request_ids: list[str]) -> int:
        with self.database.reader() as db:
            return (
                db.scalar(
                    select(func.count())
                    .select_from(UsageEvent)
                    .where(UsageEvent.operation_id.in_(request_ids))
                )
                or 0
            )


@pytest.fixture
def world(app_factory: AppFactory, database_url: str) -> Iterator[World]:
    clock = FakeClock()
    app = app_factory(database_url, clock=clock, session_ttl_seconds=10 * 24 * 3600.0)
    state = app.state.treadle
    settings = state.settings
    # Without a lifespan the engine thread never starts: the test steps this host itself.
    client = TestClient(app)
    host = WorkerHost(state.database, clock, build_engine(settings), state.store, state.notifier)
    host.register(settings.models, state.store)
    make_tenant = tenant_factory(state.database, settings, clock)

    def tenant() -> Tenant:
        headers = {"X-API-Key": make_tenant().key}
        response = client.post("/api/v1/create_session", json={}, headers=headers)
        assert response.status_code == 200, response.text
        return Tenant(headers, str(response.json()["session_id"]))

    owner, other = tenant(), tenant()
    world = World(client, host, clock, state.database, owner, other, run_id="")
    created = world.run_op(
        owner,
        "create_model",
        {
            "session_id": owner.session_id,
            "model_seq_id": 0,
            "base_model": MODEL,
            "lora_config": {"rank": 2, "seed": 1},
        },
    )
    world.run_id = str(created["model_id"])
    yield world
    state.database.dispose()


def _failed_with(world: World, tenant: Tenant, request_id: str, text: str) -> None:
    result = world.future(tenant, request_id)
    assert result.get("category") == "user", result
    assert text in result["error"], result


def test_unpublishing_stops_other_tenants_samples_already_queued(world: World) -> None:
    path = world.save_for_sampler("shared")
    world.checkpoint(path, "publish")
    theirs = world.sampler(world.other, model_path=path)
    world.sampled(world.other, theirs)
    weights = world.weights_run(path)
    assert weights in world.host.engine.run_ids()
    assert world.host.evict_ended() == []  # the other tenant may still sample them

    # Accepted while published, executed after: the worker's own check refuses it, although
    # it holds the weights already.
    waiting = world.queued_sample(world.other, theirs)
    world.checkpoint(path, "unpublish")
    world.host.drain()
    _failed_with(world, world.other, waiting, f"checkpoint {path} is no longer published")
    _failed_with(world, world.other, waiting, "ask its owner to publish it again")
    assert world.usage_of([waiting]) == 0
    # Only the other tenant's session was on them: nobody may use them now.
    assert world.host.evict_ended() == [weights]

    refused = world.sample(world.other, theirs)
    assert refused.status_code == 404
    assert f"checkpoint {path} is no longer published" in refused.json()["detail"]

    # The owner's own sessions keep sampling an unpublished checkpoint.
    mine = world.sampler(world.owner, model_path=path)
    world.sampled(world.owner, mine)
    assert world.host.evict_ended() == []
    assert weights in world.host.engine.run_ids()

    # The other tenant's session is otherwise untouched, and publishing again restores access.
    world.sampled(world.other, world.sampler(world.other, base_model=MODEL))
    world.checkpoint(path, "publish")
    world.sampled(world.other, theirs)


def test_deleting_stops_every_session_and_frees_the_weights(world: World) -> None:
    path = world.save_for_sampler("doomed")
    world.checkpoint(path, "publish")
    theirs = world.sampler(world.other, model_path=path)
    mine = world.sampler(world.owner, model_path=path)
    world.sampled(world.other, theirs)
    weights = world.weights_run(path)

    waiting = [world.queued_sample(world.other, theirs), world.queued_sample(world.owner, mine)]
    world.checkpoint(path, "delete")
    world.host.drain()
    for tenant, request_id in zip((world.other, world.owner), waiting, strict=True):
        _failed_with(world, tenant, request_id, f"checkpoint {path} was deleted")
    assert world.usage_of(waiting) == 0
    assert world.host.evict_ended() == [weights]
    for tenant, sampler_id in ((world.other, theirs), (world.owner, mine)):
        refused = world.sample(tenant, sampler_id)
        assert refused.status_code == 404
        assert "was deleted" in refused.json()["detail"]
    with world.database.reader() as db:
        refused_ops = db.scalar(
            select(func.count())
            .select_from(Operation)
            .where(Operation.target_id.in_((theirs, mine)), Operation.status == "queued")
        )
    assert refused_ops == 0


def test_expired_weights_stop_sampling_for_everyone(world: World) -> None:
    path = world.save_for_sampler("brief", ttl_seconds=3600)
    world.checkpoint(path, "publish")
    theirs = world.sampler(world.other, model_path=path)
    mine = world.sampler(world.owner, model_path=path)
    world.sampled(world.owner, mine)
    weights = world.weights_run(path)

    waiting = [world.queued_sample(world.other, theirs), world.queued_sample(world.owner, mine)]
    world.clock.advance(3601)
    world.host.drain()
    for tenant, request_id in zip((world.other, world.owner), waiting, strict=True):
        _failed_with(world, tenant, request_id, f"checkpoint {path} has expired")
    assert world.host.evict_ended() == [weights]
