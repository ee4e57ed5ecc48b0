"""An optim_step never steps on gradients that are missing a failed forward_backward.

The reproduction: a forward_backward whose datum lacks `weights` fails; the caller awaits
only the following optim_step. It must fail (category `user`, naming the failed request),
leave the weights unchanged, and let the client redo the batch - with either SDK.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import tinker
from sqlalchemy import select
from tinker import types as tinker_types

import treadle
from billing.tables import UsageEvent
from core.tables import Operation
from tests.server import LiveServer
from treadle import types

pytestmark = pytest.mark.e2e

MODEL = "treadle/tiny-1m"
TOKENS = [(7 * i) % 500 + 10 for i in range(17)]


def _refusal_names(message: str, request_id: str | None) -> int:
    """The seq_id the refusal names; also checks the request id and the reason are there."""
    match = re.search(r"forward_backward request (\S+) \(seq_id (\d+)\) failed", message)
    assert match is not None, message
    if request_id is not None:
        assert match.group(1) == request_id, message
    assert "weights" in message, message  # the failed request's own reason
    assert "unchanged" in message, message
    return int(match.group(2))


@pytest.fixture
def treadle_service(live_server: LiveServer) -> Iterator[treadle.ServiceClient]:
    with treadle.ServiceClient(
        base_url=live_server.base_url, api_key=live_server.make_tenant().key
    ) as client:
        yield client


@pytest.fixture
def tinker_service(live_server: LiveServer) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(
        base_url=live_server.base_url, api_key=live_server.make_tenant().key
    )
    yield client
    client.close("success").result(timeout=60)


def _treadle_datum(weights: bool = True) -> types.Datum:
    inputs: dict[str, list[int] | list[float]] = {"target_tokens": TOKENS[1:]}
    if weights:
        inputs["weights"] = [1.0] * (len(TOKENS) - 1)
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs=inputs)


def _tinker_datum(weights: bool = True) -> tinker_types.Datum:
    inputs: dict[str, list[int] | list[float]] = {"target_tokens": TOKENS[1:]}
    if weights:
        inputs["weights"] = [1.0] * (len(TOKENS) - 1)
    return tinker_types.Datum(
        model_input=tinker_types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs=inputs,  # type: ignore[arg-type]
    )


def test_treadle_sdk_optim_step_after_failed_forward_backward_raises(
    treadle_service: treadle.ServiceClient,
) -> None:
    trainer = treadle_service.create_lora_training_client(MODEL, rank=4, seed=3)
    adam = types.AdamParams(learning_rate=1e-2)

    def loss() -> float:
        return trainer.forward([_treadle_datum()], "cross_entropy").result().metrics["loss:sum"]

    before = loss()
    # A good forward_backward then a failing one in the same window: neither may be stepped on.
    trainer.forward_backward([_treadle_datum()], "cross_entropy")
    failed = trainer.forward_backward([_treadle_datum(weights=False)], "cross_entropy")
    step = trainer.optim_step(adam)
    with pytest.raises(treadle.RequestFailedError) as caught:
        step.result()
    assert caught.value.category == "user"
    with pytest.raises(treadle.RequestFailedError) as failure:
        failed.result()
    _refusal_names(caught.value.message, failure.value.request_id)
    assert loss() == before  # weights (and the optimizer's moments) unchanged

    # The window starts afresh: the batch sent again steps exactly as a fresh run's first step.
    trainer.forward_backward([_treadle_datum()], "cross_entropy").result()
    metrics = trainer.optim_step(adam).result().metrics
    after = loss()
    assert after < before
    fresh = treadle_service.create_lora_training_client(MODEL, rank=4, seed=3)
    fresh.forward_backward([_treadle_datum()], "cross_entropy").result()
    assert fresh.optim_step(adam).result().metrics == metrics
    assert fresh.forward([_treadle_datum()], "cross_entropy").result().metrics["loss:sum"] == (
        pytest.approx(after, rel=1e-6)
    )


def test_tinker_sdk_optim_step_after_failed_forward_backward_raises(
    tinker_service: tinker.ServiceClient,
) -> None:
    trainer = tinker_service.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
    adam = tinker_types.AdamParams(learning_rate=1e-2)

    def loss() -> float:
        out = trainer.forward([_tinker_datum()], "cross_entropy").result()
        return float(out.metrics["loss:sum"])

    before = loss()
    trainer.forward_backward([_tinker_datum(weights=False)], "cross_entropy")
    with pytest.raises(tinker.RequestFailedError) as caught:
        trainer.optim_step(adam).result()
    assert str(caught.value.category).lower().endswith("user")
    _refusal_names(caught.value.message, None)
    assert loss() == before

    trainer.forward_backward([_tinker_datum()], "cross_entropy").result()
    assert (trainer.optim_step(adam).result().metrics or {})["grad_norm:mean"] > 0
    assert loss() < before


def test_failed_forward_only_never_refuses_a_step(
    treadle_service: treadle.ServiceClient,
) -> None:
    trainer = treadle_service.create_lora_training_client(MODEL, rank=4, seed=3)
    forward = trainer.forward([_treadle_datum(weights=False)], "cross_entropy")
    trainer.forward_backward([_treadle_datum()], "cross_entropy")
    step = trainer.optim_step(types.AdamParams(learning_rate=1e-2))
    with pytest.raises(treadle.RequestFailedError):
        forward.result()
    assert (step.result().metrics or {})["grad_norm:mean"] > 0


def test_failed_requests_bill_nothing_and_forward_bills_its_tokens(
    live_server: LiveServer,
) -> None:
    tenant = live_server.make_tenant()
    with treadle.ServiceClient(base_url=live_server.base_url, api_key=tenant.key) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, seed=3)
        trainer.forward([_treadle_datum()], "cross_entropy").result()
        trainer.forward_backward([_treadle_datum(weights=False)], "cross_entropy")
        with pytest.raises(treadle.RequestFailedError):
            trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    with live_server.database.reader() as db:
        billed = db.execute(
            select(Operation.kind, Operation.status, UsageEvent.kind, UsageEvent.quantity)
            .join(UsageEvent, UsageEvent.operation_id == Operation.id)
            .where(Operation.tenant_id == tenant.tenant_id)
        ).all()
    # Only the forward pass: its datum's model_input tokens, as training.
    assert billed == [("forward_backward", "done", "training", len(TOKENS) - 1)]
