"""The official tinker SDK meets tenant limits: a run beyond the tenant's limit fails at once
(403, never retried); a request beyond a full queue is answered 429, which the SDK retries,
resubmitting the same request until it is admitted, so the work comes out as without a limit.

The engine is held back while the queue fills, and released by the first 429 the server sends,
so every test meets a full queue whatever the machine's speed.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import pytest
import tinker
from sqlalchemy import select
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from tinker import types

from core import tenants
from core.db import Database
from core.tables import Operation, Tenant
from scheduler.worker.embedded import EmbeddedDispatcher
from scheduler.worker.host import WorkerHost, build_engine
from tests.builders import TenantFactory, tenant_factory
from tests.server import build_app, running_server

pytestmark = pytest.mark.e2e

MODEL = "treadle/tiny-1m"


class Gate:
    """Holds the engine back while closed; the first 429 the server answers opens it."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.opened.set()
        self.statuses: list[tuple[str, int]] = []

    def close(self) -> None:
        self.opened.clear()


class GatedHost:
    def __init__(self, host: WorkerHost, gate: Gate) -> None:
        self.host, self.gate = host, gate

    def drain(self) -> int:
        return self.host.drain() if self.gate.opened.wait(0.05) else 0


class StatusRecorder:
    """ASGI middleware noting each response's path and status."""

    def __init__(self, app: ASGIApp, gate: Gate) -> None:
        self.app, self.gate = app, gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def noting(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.gate.statuses.append((scope["path"], message["status"]))
                if message["status"] == 429:
                    self.gate.opened.set()
            await send(message)

        await self.app(scope, receive, noting if scope["type"] == "http" else send)


@dataclasses.dataclass
class Served:
    base_url: str
    database: Database
    make_tenant: TenantFactory
    gate: Gate

    def client(self, **limits: int) -> tinker.ServiceClient:
        key = self.make_tenant()
        with self.database.transaction() as db:
            tenant = db.get(Tenant, key.tenant_id)
            assert tenant is not None
            tenants.update_tenant_limits(db, tenant, limits=limits)
        return tinker.ServiceClient(base_url=self.base_url, api_key=key.key)

    def refused(self, path: str, status: int) -> int:
        return self.gate.statuses.count((f"/api/v1/{path}", status))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    app = build_app(tmp_path_factory.mktemp("limits"))
    state = app.state.treadle
    settings = state.settings
    gate = Gate()

    def gated_host() -> GatedHost:
        engine = build_engine(settings)
        host = WorkerHost(state.database, state.clock, engine, state.store, state.notifier)
        host.register(settings.models, state.store)
        return GatedHost(host, gate)

    state.dispatcher = EmbeddedDispatcher(gated_host)  # type: ignore[arg-type]
    app.add_middleware(StatusRecorder, gate=gate)
    with running_server(app) as base_url:
        assert state.dispatcher.wait_ready(120), "engine did not start"
        yield Served(base_url, state.database, tenant_factory(state.database, settings), gate)


def _datum(offset: int) -> types.Datum:
    tokens = [(7 * i + offset) % 500 + 10 for i in range(17)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 16},
    )


def test_a_run_beyond_the_limit_is_refused_at_once(served: Served) -> None:
    service = served.client(max_training_runs=1)
    service.create_lora_training_client(base_model=MODEL, rank=2).result()
    with pytest.raises(tinker.PermissionDeniedError) as refused:
        service.create_lora_training_client(base_model=MODEL, rank=2).result()
    assert "allows 1 live training runs and 1 are live" in str(refused.value)
    assert served.refused("create_model", 403) == 1  # not retried
    service.close("success").result(timeout=60)


def _train(served: Served, service: tinker.ServiceClient, hold: bool) -> tuple[list[float], str]:
    """Three forward_backward + optim_step pairs submitted at once; their losses, and the run."""
    trainer = service.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
    if hold:
        served.gate.close()
    batch = [_datum(i) for i in range(2)]
    futures = []
    for _ in range(3):
        futures.append(trainer.forward_backward(batch, "cross_entropy"))
        futures.append(trainer.optim_step(types.AdamParams(learning_rate=5e-3)))
    results = [future.result() for future in futures]
    service.close("success").result(timeout=60)
    return [result.metrics["loss:sum"] for result in results[::2]], str(trainer.model_id)


def test_a_full_queue_is_retried_by_the_sdk_and_loses_nothing(served: Served) -> None:
    expected, _ = _train(served, served.client(), hold=False)
    refused_before = served.refused("forward_backward", 429) + served.refused("optim_step", 429)

    losses, run_id = _train(served, served.client(max_queued_ops=1), hold=True)

    refused = served.refused("forward_backward", 429) + served.refused("optim_step", 429)
    assert refused > refused_before  # the queue was full, and the SDK came back
    assert losses == pytest.approx(expected, rel=1e-6)
    with served.database.reader() as db:
        ops = db.execute(
            select(Operation.seq_id, Operation.status).where(Operation.target_id == run_id)
        ).all()
    assert sorted(ops) == [(seq_id, "done") for seq_id in range(7)]  # each request ran once


def test_sampling_beyond_the_limit_is_retried_by_the_sdk(served: Served) -> None:
    params = types.SamplingParams(max_tokens=4, seed=5)
    prompt = types.ModelInput.from_ints([11, 12, 13])
    unlimited, limited = served.client(), served.client(max_sampling_requests=1)
    reference = unlimited.create_sampling_client(base_model=MODEL).result()
    expected = [reference.sample(prompt, 1, params).result() for _ in range(3)]

    sampler = limited.create_sampling_client(base_model=MODEL).result()
    refused_before = served.refused("asample", 429)
    served.gate.close()
    futures = [sampler.sample(prompt, 1, params) for _ in range(3)]
    results = [future.result() for future in futures]
    for service in (unlimited, limited):
        service.close("success").result(timeout=60)

    assert served.refused("asample", 429) > refused_before
    assert [r.sequences[0].tokens for r in results] == [r.sequences[0].tokens for r in expected]
