"""Spend limits seen by real clients. The official tinker SDK, answered 402 at its tenant's
limit, pauses its training loop instead of failing, and goes on once the operator raises the
limit; the treadle SDK raises SpendLimitReachedError with the server's message; concurrent
submitters on PostgreSQL overshoot a limit by at most one op each.

Training is priced at one micro-unit per token on the test model, so a forward_backward of
two 16-token datums costs 32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import tinker
from sqlalchemy import select
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from tinker import types

import treadle
from billing.spend import period_spend
from billing.tables import Price
from core import tenants
from core.clock import SystemClock
from core.db import Database
from core.tables import Operation, OpStatus, Tenant
from tests.builders import TenantFactory, TenantKey, tenant_factory
from tests.e2e.treadle_data import sft_datum
from tests.server import build_app, running_server

pytestmark = pytest.mark.e2e

MODEL = "treadle/tiny-1m"
FB_COST = 32  # micro-units: two datums of 16 tokens


class Refusals:
    """The paths answered 402, and an event set at the first."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.first = threading.Event()


class PaymentRequiredSeen:
    """ASGI middleware noting each 402 answer in `refusals`."""

    def __init__(self, app: ASGIApp, refusals: Refusals) -> None:
        self.app, self.refusals = app, refusals

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def noting(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 402:
                self.refusals.paths.append(scope["path"])
                self.refusals.first.set()
            await send(message)

        await self.app(scope, receive, noting if scope["type"] == "http" else send)


def _price_training(database: Database) -> None:
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    with database.transaction() as db:
        db.add(
            Price(
                base_model=MODEL,
                kind="training",
                unit_micros=1_000_000,
                cached_unit_micros=None,
                effective_from=epoch,
                created_at=epoch,
                created_by="test",
            )
        )


def _set_limits(database: Database, tenant_id: str, **limits: int | None) -> None:
    with database.transaction() as db:
        tenant = db.get(Tenant, tenant_id)
        assert tenant is not None
        tenants.set_spend_limits(db, SystemClock(), tenant, **limits)  # type: ignore[arg-type]


def _datum(offset: int) -> types.Datum:
    tokens = [(7 * i + offset) % 500 + 10 for i in range(17)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 16},
    )


@dataclasses.dataclass
class Served:
    base_url: str
    database: Database
    make_tenant: TenantFactory
    refusals: Refusals

    def tenant(self, **limits: int | None) -> TenantKey:
        key = self.make_tenant()
        _set_limits(self.database, key.tenant_id, **limits)
        return key


@contextlib.contextmanager
def _serve(root: Path, database_url: str | None = None) -> Iterator[Served]:
    app = build_app(root, database_url)
    state = app.state.treadle
    _price_training(state.database)
    refusals = Refusals()
    app.add_middleware(PaymentRequiredSeen, refusals=refusals)
    with running_server(app) as base_url:
        assert state.dispatcher.wait_ready(120), "engine did not start"
        yield Served(
            base_url, state.database, tenant_factory(state.database, state.settings), refusals
        )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with _serve(tmp_path_factory.mktemp("spend")) as served:
        yield served


def test_the_tinker_sdk_pauses_at_the_limit_and_goes_on_once_it_is_raised(
    served: Served,
) -> None:
    key = served.tenant(monthly_micros=100)  # the fourth forward_backward crosses it
    service = tinker.ServiceClient(base_url=served.base_url, api_key=key.key)
    trainer = service.create_lora_training_client(base_model=MODEL, rank=2, seed=1).result()

    def raise_the_limit() -> None:
        assert served.refusals.first.wait(300), "the limit was never reached"
        _set_limits(served.database, key.tenant_id, monthly_micros=1_000_000)

    raiser = threading.Thread(target=raise_the_limit)
    raiser.start()
    losses = []
    for step in range(6):  # the loop knows nothing of limits: the SDK waits the 402s out
        fwd = trainer.forward_backward([_datum(2 * step), _datum(2 * step + 1)], "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        losses.append(fwd.result().metrics["loss:sum"])
    raiser.join()
    service.close("success").result(timeout=60)

    assert len(losses) == 6
    assert served.refusals.paths and set(served.refusals.paths) <= {
        "/api/v1/forward_backward",
        "/api/v1/optim_step",
    }
    with served.database.reader() as db:
        statuses = db.execute(
            select(Operation.seq_id, Operation.status).where(
                Operation.target_id == str(trainer.model_id)
            )
        ).all()
        spent = period_spend(db, key.tenant_id, datetime.now(UTC))
    assert sorted(statuses) == [(seq, OpStatus.DONE) for seq in range(13)]  # each ran once
    assert spent == 6 * FB_COST


def test_a_limit_of_zero_refuses_the_first_priced_op_with_what_to_do(served: Served) -> None:
    key = served.tenant(monthly_micros=0)
    with treadle.ServiceClient(base_url=served.base_url, api_key=key.key) as service:
        trainer = service.create_lora_training_client(MODEL, rank=2)  # creating costs nothing
        with pytest.raises(treadle.SpendLimitReachedError) as refused:
            trainer.forward_backward([sft_datum(0, length=16)], "cross_entropy").result()
        estimate = service.create_rest_client().estimate_cost(MODEL, {"training": 16}).result()
    error = refused.value
    assert error.status_code == 402 and error.code == "spend_limit_reached"
    assert f"tenant {key.tenant_name!r} has spent $0.00" in error.message
    assert "of its $0.00 limit for the billing period" in error.message
    assert f"treadle-server admin tenants set-limit {key.tenant_name} --monthly" in error.message
    assert estimate.total_micros == 16


def test_a_session_limit_refuses_that_session_only(served: Served) -> None:
    key = served.tenant(per_session_micros=FB_COST)
    batch = [sft_datum(0, length=16), sft_datum(1, length=16)]
    with treadle.ServiceClient(base_url=served.base_url, api_key=key.key) as first:
        trainer = first.create_lora_training_client(MODEL, rank=2)
        trainer.forward_backward(batch, "cross_entropy").result()  # spends the session's all
        with pytest.raises(treadle.SpendLimitReachedError, match="session spend limit reached"):
            trainer.forward_backward(batch, "cross_entropy").result()
    with treadle.ServiceClient(base_url=served.base_url, api_key=key.key) as second:
        trainer = second.create_lora_training_client(MODEL, rank=2)
        trainer.forward_backward(batch, "cross_entropy").result()


def test_concurrent_submitters_overshoot_by_at_most_one_op_each(
    tmp_path: Path, postgres_url: str
) -> None:
    limit, submitters = 40 * FB_COST, 20
    admitted = [0] * submitters
    barrier = threading.Barrier(submitters)
    with _serve(tmp_path, postgres_url) as server:
        key = server.tenant(monthly_micros=limit)
        with treadle.ServiceClient(base_url=server.base_url, api_key=key.key) as service:

            def submitter(i: int) -> None:
                trainer = service.create_lora_training_client(MODEL, rank=2, seed=i)
                batch = [sft_datum(i, length=16), sft_datum(i + 1, length=16)]
                barrier.wait()
                while True:
                    try:
                        trainer.forward_backward(batch, "cross_entropy").result()
                    except treadle.SpendLimitReachedError:
                        return
                    admitted[i] += 1

            threads = [threading.Thread(target=submitter, args=(i,)) for i in range(submitters)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(300)
        with server.database.reader() as db:
            spent = period_spend(db, key.tenant_id, datetime.now(UTC))
    # Each admitted op ran and was billed; the last ones admitted crossed the limit together.
    assert spent == sum(admitted) * FB_COST
    assert limit <= spent <= limit + submitters * FB_COST
