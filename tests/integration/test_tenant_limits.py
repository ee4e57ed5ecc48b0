"""Per-tenant resource limits: live training runs and their LoRA parameters (403), operations
and sampling requests in flight (429 with Retry-After).

The app runs without its engine thread; the tests step a real worker host themselves, so a
request meets the tenant at its limit, and is admitted again once real work (an unload, an
executed op, an ended session) has freed capacity. A refused request leaves no run, operation
or usage behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, inspect, select, text

from api.dbschema import downgrade, upgrade
from billing.tables import UsageEvent
from core import tenants
from core.clock import SystemClock
from core.db import Database
from core.errors import InvalidInput
from core.tables import Operation, Tenant, TrainingRun
from scheduler.worker.host import WorkerHost, build_engine
from tests import services
from tests.builders import TenantFactory, tenant_factory
from tests.server import AppFactory, build_app, running_server

pytestmark = pytest.mark.integration

MODEL = "treadle/tiny-1m"
# LoRA parameters per unit of rank of tiny-1m (hidden 128, 4 layers, MLP 512, vocabulary 1024):
# attention 4 layers × 4 projections × (128 + 128), MLP 4 × 3 × (128 + 512), unembedding
# 128 + 1024. A rank-r adapter on all three holds r × 12,928.
ATTN, MLP, UNEMBED = 4096, 7680, 1152
ALL_PARTS = ATTN + MLP + UNEMBED
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}


@dataclasses.dataclass
class Client:
    tenant_id: str
    name: str
    headers: dict[str, str]
    session_id: str
    seqs: itertools.count[int] = dataclasses.field(default_factory=lambda: itertools.count(1))


@dataclasses.dataclass
class World:
    client: TestClient
    host: WorkerHost
    database: Database
    make_tenant: TenantFactory

    def tenant(self, **limits: int) -> Client:
        key = self.make_tenant()
        with self.database.transaction() as db:
            row = db.get(Tenant, key.tenant_id)
            assert row is not None
            tenants.update_tenant_limits(db, row, limits=limits)
        headers = {"X-API-Key": key.key}
        return Client(key.tenant_id, key.tenant_name, headers, self.new_session(headers))

    def new_session(self, headers: dict[str, str]) -> str:
        response = self.client.post("/api/v1/create_session", json={}, headers=headers)
        assert response.status_code == 200, response.text
        return str(response.json()["session_id"])

    def post(self, who: Client, route: str, body: dict[str, Any]) -> httpx.Response:
        return self.client.post(f"/api/v1/{route}", json=body, headers=who.headers)

    def create_model(
        self, who: Client, model_seq_id: int, rank: int = 2, **lora: bool
    ) -> httpx.Response:
        return self.post(
            who,
            "create_model",
            {
                "session_id": who.session_id,
                "model_seq_id": model_seq_id,
                "base_model": MODEL,
                "lora_config": {"rank": rank, "seed": 1, **lora},
            },
        )

    def optim_step(self, who: Client, run_id: str, seq_id: int) -> httpx.Response:
        body = {"model_id": run_id, "seq_id": seq_id, "adam_params": {"learning_rate": 0.01}}
        return self.post(who, "optim_step", body)

    def sample(self, who: Client, sampler_id: str, seq_id: int) -> httpx.Response:
        body = {
            "sampling_session_id": sampler_id,
            "seq_id": seq_id,
            "num_samples": 1,
            "prompt": PROMPT,
            "sampling_params": {"max_tokens": 2, "seed": 1},
        }
        return self.post(who, "asample", body)

    def result(self, who: Client, response: httpx.Response) -> dict[str, Any]:
        """Run what is queued, then the finished op's result."""
        assert response.status_code == 200, response.text
        self.host.drain()
        body: dict[str, Any] = self.post(
            who, "retrieve_future", {"request_id": response.json()["request_id"]}
        ).json()
        assert body.get("type") != "try_again" and "error" not in body, body
        return body

    def holdings(self, who: Client) -> tuple[int, int, int]:
        """The tenant's training runs, operations and usage events."""
        with self.database.reader() as db:
            counts = [
                db.scalar(
                    select(func.count()).select_from(table).where(table.tenant_id == who.tenant_id)
                )
                for table in (TrainingRun, Operation, UsageEvent)
            ]
        return counts[0] or 0, counts[1] or 0, counts[2] or 0


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    root = tmp_path_factory.mktemp(f"limits-{request.param}")
    database: contextlib.AbstractContextManager[str]
    if request.param == "sqlite":
        database = contextlib.nullcontext(f"sqlite:///{root / 'treadle.db'}")
    else:
        database = services.throwaway_database(request.getfixturevalue("postgres_admin_url"))
    with database as url:
        app = build_app(root, url)
        state = app.state.treadle
        settings = state.settings
        # Without a lifespan the engine thread never starts: the tests step this host.
        host = WorkerHost(
            state.database, SystemClock(), build_engine(settings), state.store, state.notifier
        )
        host.register(settings.models, state.store)
        yield World(TestClient(app), host, state.database, tenant_factory(state.database, settings))
        state.database.dispose()


def test_live_training_runs_are_limited_per_tenant(world: World) -> None:
    who = world.tenant(max_training_runs=2)
    first = world.result(who, world.create_model(who, 0))
    second = world.create_model(who, 1)
    assert second.status_code == 200, second.text
    saved = world.post(
        who, "save_weights", {"model_id": first["model_id"], "path": "c", "seq_id": 1}
    )
    checkpoint = world.result(who, saved)["path"]
    load = {"session_id": who.session_id, "path": checkpoint, "optimizer": False}
    before = world.holdings(who)

    refused = world.create_model(who, 2)
    assert refused.status_code == 403, refused.text
    detail = refused.json()["detail"]
    assert f"tenant {who.name!r} allows 2 live training runs and 2 are live" in detail
    assert "unload one" in detail and "max_training_runs" in detail
    assert refused.headers["x-should-retry"] == "false"
    from_checkpoint = world.post(who, "load_weights", {**load, "model_seq_id": 3})
    assert from_checkpoint.status_code == 403, from_checkpoint.text
    assert "allows 2 live training runs" in from_checkpoint.json()["detail"]
    assert world.holdings(who) == before
    # A retried creation is answered with its run, limits or not.
    retried = world.create_model(who, 1)
    assert retried.status_code == 200, retried.text
    assert retried.json() == second.json()

    # A run stays live until its unload has run.
    unload = world.post(who, "unload_model", {"model_id": first["model_id"]})
    assert world.create_model(who, 2).status_code == 403
    world.result(who, unload)
    assert world.result(who, world.post(who, "load_weights", {**load, "model_seq_id": 3}))
    assert world.create_model(who, 4).status_code == 403

    # Ending the session ends its runs.
    finished = world.post(who, f"sessions/{who.session_id}/finish", {"reason": {"type": "success"}})
    assert finished.status_code == 200, finished.text
    who.session_id = world.new_session(who.headers)
    assert [world.create_model(who, n).status_code for n in range(3)] == [200, 200, 403]


def test_lora_parameters_are_limited_per_tenant(world: World) -> None:
    who = world.tenant(max_lora_parameters=8 * ALL_PARTS)
    half = world.create_model(who, 0, rank=4)
    assert half.status_code == 200, half.text
    assert world.create_model(who, 1, rank=4).status_code == 200  # exactly at the limit
    before = world.holdings(who)

    refused = world.create_model(who, 2, rank=1, train_mlp=False, train_unembed=False)
    assert refused.status_code == 403, refused.text
    detail = refused.json()["detail"]
    assert (
        f"tenant {who.name!r} allows {8 * ALL_PARTS:,} LoRA parameters across its live training "
        f"runs, {8 * ALL_PARTS:,} are in use, and this rank-1 adapter on {MODEL} (attn) needs "
        f"{ATTN:,}"
    ) in detail
    assert "max_lora_parameters" in detail
    assert world.holdings(who) == before

    world.result(who, world.post(who, "unload_model", {"model_id": half.json()["model_id"]}))
    # 4 × 12,928 free: a rank-4 adapter without unembedding fits, then only attention.
    assert world.create_model(who, 3, rank=4, train_unembed=False).status_code == 200
    assert world.create_model(who, 4, rank=1).status_code == 403
    assert (
        world.create_model(who, 5, rank=1, train_mlp=False, train_unembed=False).status_code == 200
    )


def test_queued_operations_are_limited_per_tenant(world: World) -> None:
    who = world.tenant(max_queued_ops=3)
    run_id = world.result(who, world.create_model(who, 0))["model_id"]
    first = world.optim_step(who, run_id, 1)
    assert first.status_code == 200, first.text
    fb = {
        "model_id": run_id,
        "seq_id": 2,
        "data": [
            {
                "model_input": PROMPT,
                "loss_fn_inputs": {
                    "target_tokens": {"data": [6, 7, 8], "dtype": "int64"},
                    "weights": {"data": [1.0, 1.0, 1.0], "dtype": "float32"},
                },
            }
        ],
        "loss_fn": "cross_entropy",
    }
    assert world.post(who, "forward_backward", fb).status_code == 200
    assert world.optim_step(who, run_id, 3).status_code == 200
    before = world.holdings(who)

    for refused in (
        world.optim_step(who, run_id, 4),
        world.post(who, "forward_backward", {**fb, "seq_id": 4}),
    ):
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        assert "x-should-retry" not in refused.headers  # the SDKs retry it
        detail = refused.json()["detail"]
        assert f"tenant {who.name!r} allows 3 operations queued or running and 3 are" in detail
        assert "max_queued_ops" in detail
    assert world.holdings(who) == before
    # A resubmission of an accepted request is answered as before.
    again = world.optim_step(who, run_id, 1)
    assert again.status_code == 200 and again.json() == first.json()

    world.result(who, first)  # the queue drains: the refused request goes through now
    assert world.result(who, world.optim_step(who, run_id, 4))
    # unload_model frees resources: a full queue never holds it back.
    for seq_id in (5, 6, 7):
        assert world.optim_step(who, run_id, seq_id).status_code == 200
    assert world.optim_step(who, run_id, 8).status_code == 429
    assert world.post(who, "unload_model", {"model_id": run_id}).status_code == 200


def test_the_op_a_run_waits_for_passes_a_full_queue(world: World) -> None:
    """Ops that arrived out of order fill the queue while they wait for an earlier seq_id:
    refusing that one would stall them all until their gap is given up."""
    who = world.tenant(max_queued_ops=2)
    run_id = world.result(who, world.create_model(who, 0))["model_id"]
    waiting = [world.optim_step(who, run_id, seq_id) for seq_id in (2, 3)]
    assert [r.status_code for r in waiting] == [200, 200]
    assert world.optim_step(who, run_id, 4).status_code == 429
    awaited = world.optim_step(who, run_id, 1)
    assert awaited.status_code == 200, awaited.text
    for response in (awaited, *waiting):
        assert "grad_norm:mean" in world.result(who, response)["metrics"]
    assert world.result(who, world.optim_step(who, run_id, 4))


def test_sampling_requests_in_flight_are_limited_per_tenant(world: World) -> None:
    who = world.tenant(max_sampling_requests=2)
    created = world.post(
        who,
        "create_sampling_session",
        {"session_id": who.session_id, "sampling_session_seq_id": 0, "base_model": MODEL},
    )
    assert created.status_code == 200, created.text
    sampler = created.json()["sampling_session_id"]
    first = world.sample(who, sampler, 1)
    assert first.status_code == 200, first.text
    assert world.sample(who, sampler, 2).status_code == 200
    before = world.holdings(who)

    refused = world.sample(who, sampler, 3)
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "1"
    detail = refused.json()["detail"]
    assert f"tenant {who.name!r} allows 2 sampling requests queued or running and 2 are" in detail
    assert "max_sampling_requests" in detail
    assert world.holdings(who) == before
    assert world.sample(who, sampler, 1).json() == first.json()  # a resubmission

    world.result(who, first)
    assert world.result(who, world.sample(who, sampler, 3))
    assert world.sample(who, sampler, 4).status_code == 200
    assert world.sample(who, sampler, 5).status_code == 200
    assert world.sample(who, sampler, 6).status_code == 429
    # Other operations are not sampling requests.
    run = world.create_model(who, 0)
    assert run.status_code == 200, run.text


class Parked:
    """A dispatcher with no engine, as when no worker has started: ops stay queued."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def assign(self, db: object, target_id: str) -> str | None:
        return None

    def wake(self, worker_id: str | None = None) -> None:
        pass

    def wait_ready(self, timeout: float) -> bool:
        return True

    @property
    def failure(self) -> str | None:
        return None


def _concurrently(
    base_url: str, requests: list[tuple[str, dict[str, Any]]], key: str
) -> list[httpx.Response]:
    def post(request: tuple[str, dict[str, Any]]) -> httpx.Response:
        with httpx.Client(base_url=base_url, timeout=60) as client:
            return client.post(f"/api/v1/{request[0]}", json=request[1], headers={"X-API-Key": key})

    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        return list(pool.map(post, requests))


def test_concurrent_creates_respect_a_limit_of_three_runs(
    app_factory: AppFactory, database_url: str, migrated: Database
) -> None:
    app = app_factory(database_url)
    app.state.treadle.dispatcher = Parked()
    key = tenant_factory(migrated, app.state.treadle.settings)().key
    with running_server(app) as base_url:
        sessions = [
            httpx.post(
                f"{base_url}/api/v1/create_session", json={}, headers={"X-API-Key": key}
            ).json()["session_id"]
            for _ in range(2)
        ]
        with migrated.transaction() as db:
            tenant = db.scalar(select(Tenant))
            assert tenant is not None
            tenants.update_tenant_limits(db, tenant, limits={"max_training_runs": 3})
        creates = [
            (
                "create_model",
                {
                    "session_id": sessions[n % 2],
                    "model_seq_id": n,
                    "base_model": MODEL,
                    "lora_config": {"rank": 2},
                },
            )
            for n in range(40)
        ]
        responses = _concurrently(base_url, creates, key)

    statuses = [r.status_code for r in responses]
    assert statuses.count(200) == 3, [r.text for r in responses if r.status_code not in (200, 403)]
    assert statuses.count(403) == 37
    with migrated.reader() as db:
        assert db.scalar(select(func.count()).select_from(TrainingRun)) == 3
        assert db.scalar(select(func.count()).select_from(Operation)) == 3


def test_concurrent_submissions_respect_a_limit_of_five_queued_ops(
    app_factory: AppFactory, database_url: str, migrated: Database
) -> None:
    app = app_factory(database_url)
    app.state.treadle.dispatcher = Parked()
    key = tenant_factory(migrated, app.state.treadle.settings)().key
    with migrated.transaction() as db:
        tenant = db.scalar(select(Tenant))
        assert tenant is not None
        tenants.update_tenant_limits(db, tenant, limits={"max_queued_ops": 5})
    with running_server(app) as base_url:
        headers = {"X-API-Key": key}
        session = httpx.post(f"{base_url}/api/v1/create_session", json={}, headers=headers).json()
        created = httpx.post(
            f"{base_url}/api/v1/create_model",
            json={"session_id": session["session_id"], "model_seq_id": 0, "base_model": MODEL},
            headers=headers,
        )
        assert created.status_code == 200, created.text
        run_id = created.json()["model_id"]
        steps = [
            (
                "optim_step",
                {"model_id": run_id, "seq_id": n, "adam_params": {"learning_rate": 0.01}},
            )
            for n in range(1, 31)
        ]
        responses = _concurrently(base_url, steps, key)

    statuses = [r.status_code for r in responses]
    assert statuses.count(200) == 4, [r.text for r in responses if r.status_code not in (200, 429)]
    assert statuses.count(429) == 26
    with migrated.reader() as db:
        assert db.scalar(select(func.count()).select_from(Operation)) == 5


def test_limits_are_checked_when_set(migrated: Database) -> None:
    with migrated.transaction() as db:
        tenant = tenants.create_tenant(
            db,
            SystemClock(),
            "acme",
            max_concurrent_sessions=1,
            max_lora_rank=8,
            limits={"max_queued_ops": 7},
        )
        assert tenants.resource_limits(tenant) == dataclasses.replace(
            tenants.DEFAULT_LIMITS, max_queued_ops=7
        )
        refusals = (
            ({"max_training_runs": -1}, "max_training_runs -1 is outside 0..2147483647"),
            ({"max_queued_ops": 2**31}, "max_queued_ops 2147483648 is outside 0..2147483647"),
            ({"max_runs": 3}, "unknown resource limit 'max_runs'"),
        )
        for bad, message in refusals:
            with pytest.raises(InvalidInput) as refused:
                tenants.update_tenant_limits(db, tenant, limits=bad)
            assert message in refused.value.message
        assert tenant.max_training_runs is None and tenant.max_queued_ops == 7
        tenants.update_tenant_limits(
            db, tenant, limits={"max_queued_ops": None, "max_lora_parameters": 0}
        )
        assert tenant.max_queued_ops is None and tenant.max_lora_parameters == 0


def test_upgrading_a_database_keeps_its_tenants_on_the_defaults(database_url: str) -> None:
    database = Database(database_url)
    upgrade(database, "0001")
    with database.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO tenants (id, name, max_concurrent_sessions, max_lora_rank, disabled, "
                "created_at) VALUES ('tn_old', 'old', 2, 16, false, CURRENT_TIMESTAMP)"
            )
        )
    upgrade(database)
    with database.transaction() as db:
        tenant = db.get(Tenant, "tn_old")
        assert tenant is not None
        assert tenants.resource_limits(tenant) == tenants.DEFAULT_LIMITS
        tenants.update_tenant_limits(db, tenant, limits={"max_training_runs": 5})

    downgrade(database, "0001")
    columns = {c["name"] for c in inspect(database.engine).get_columns("tenants")}
    assert not columns & set(tenants.RESOURCE_LIMIT_NAMES)
    with database.engine.connect() as conn:
        assert conn.execute(text("SELECT name FROM tenants")).scalars().all() == ["old"]
    database.dispose()
