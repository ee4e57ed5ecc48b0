"""Usage is recorded once per operation and kind, and equals the tokens actually processed."""

from __future__ import annotations

import httpx
import pytest
import tinker
from sqlalchemy import func, select
from tinker import types

from billing.tables import UsageEvent
from core.tables import Operation
from tests.scenarios import MODEL, sft_datum
from tests.server import LiveServer
from treadle.types import Datum, ForwardBackwardRequest, ModelInput, TensorData
from treadle.wire import encode_forward_backward_request

pytestmark = pytest.mark.e2e


def _totals(server: LiveServer, tenant_id: str) -> dict[str, int]:
    with server.database.reader() as db:
        rows = db.execute(
            select(UsageEvent.kind, func.sum(UsageEvent.quantity))
            .where(UsageEvent.tenant_id == tenant_id)
            .group_by(UsageEvent.kind)
        )
        return {kind: int(total) for kind, total in rows}


def test_ledger_matches_the_work_done(live_server: LiveServer) -> None:
    tenant = live_server.make_tenant()
    client = tinker.ServiceClient(base_url=live_server.base_url, api_key=tenant.key)
    trained = prefill = sampled = checkpoints = 0

    trainer = client.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
    batch = [sft_datum(i, length=10 + 3 * i) for i in range(3)]
    for _ in range(2):
        trainer.forward_backward(batch, "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        trained += sum(d.model_input.length for d in batch)

    sampler = trainer.save_weights_and_get_sampling_client().result()
    checkpoints += 1
    prompt = types.ModelInput.from_ints([30, 31, 32, 33, 34])
    result = sampler.sample(
        prompt, num_samples=3, sampling_params=types.SamplingParams(max_tokens=4, seed=2)
    ).result()
    prefill += prompt.length
    sampled += sum(len(s.tokens) for s in result.sequences)
    logprob_prompt = types.ModelInput.from_ints([40, 41, 42])
    sampler.compute_logprobs(logprob_prompt).result()
    prefill += logprob_prompt.length
    sampled += 1  # compute_logprobs is a one-token sample whose token the SDK drops

    rl_data = []
    for seq in result.sequences:
        tokens = prompt.to_ints() + seq.tokens
        pad = prompt.length - 1
        rl_data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "logprobs": [0.0] * pad + list(seq.logprobs or []),
                    "advantages": [0.0] * pad + [0.5] * len(seq.tokens),
                },
            )
        )
    trainer.forward_backward(rl_data, "importance_sampling")
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    trained += sum(d.model_input.length for d in rl_data)
    trainer.save_state("end").result()
    checkpoints += 1
    client.close("success").result(timeout=60)

    expected = {
        "training": trained,
        "sampling_prefill": prefill,
        "sampling_sample": sampled,
        "checkpoint": checkpoints,
    }
    assert _totals(live_server, tenant.tenant_id) == expected
    with live_server.database.reader() as db:
        per_op_kind = db.execute(
            select(UsageEvent.operation_id, UsageEvent.kind, func.count())
            .where(UsageEvent.tenant_id == tenant.tenant_id)
            .group_by(UsageEvent.operation_id, UsageEvent.kind)
        ).all()
        assert per_op_kind and all(count == 1 for _, _, count in per_op_kind)
        ops = db.scalar(
            select(func.count())
            .select_from(Operation)
            .where(Operation.tenant_id == tenant.tenant_id)
        )

    # Once the session is finished, further work is refused and nothing changes.
    body = encode_forward_backward_request(
        ForwardBackwardRequest(
            model_id=trainer.model_id, seq_id=99, loss_fn="cross_entropy", data=_wire_batch(batch)
        )
    )
    response = httpx.post(
        f"{live_server.base_url}/api/v1/forward_backward",
        content=body,
        headers={"X-API-Key": tenant.key, "Content-Type": "application/x-protobuf"},
    )
    assert response.status_code == 404
    assert _totals(live_server, tenant.tenant_id) == expected
    with live_server.database.reader() as db:
        assert (
            db.scalar(
                select(func.count())
                .select_from(Operation)
                .where(Operation.tenant_id == tenant.tenant_id)
            )
            == ops
        )


def test_resubmitted_request_runs_once(live_server: LiveServer) -> None:
    tenant = live_server.make_tenant()
    client = tinker.ServiceClient(base_url=live_server.base_url, api_key=tenant.key)
    trainer = client.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
    batch = [sft_datum(0)]
    first = trainer.forward_backward(batch, "cross_entropy").result()
    run_id = trainer.model_id
    with live_server.database.reader() as db:
        original = db.scalar(
            select(Operation.id).where(Operation.target_id == run_id, Operation.seq_id == 1)
        )
    before = _totals(live_server, tenant.tenant_id)
    body = encode_forward_backward_request(
        ForwardBackwardRequest(
            model_id=run_id, seq_id=1, loss_fn="cross_entropy", data=_wire_batch(batch)
        )
    )
    for _ in range(2):
        response = httpx.post(
            f"{live_server.base_url}/api/v1/forward_backward",
            content=body,
            headers={"X-API-Key": tenant.key, "Content-Type": "application/x-protobuf"},
        )
        assert response.status_code == 200, response.text
        assert response.json()["request_id"] == original
    assert _totals(live_server, tenant.tenant_id) == before
    # ...and the client's own next request still runs in order.
    second = trainer.forward_backward(batch, "cross_entropy").result()
    assert second.metrics["loss:sum"] == pytest.approx(first.metrics["loss:sum"], rel=1e-5)
    client.close("success").result(timeout=60)


def _wire_batch(batch: list[types.Datum]) -> list[Datum]:
    """The same data as treadle wire types, to post raw requests."""
    return [
        Datum(
            model_input=ModelInput.from_ints(d.model_input.to_ints()),
            loss_fn_inputs={
                "target_tokens": TensorData.from_list(
                    d.loss_fn_inputs["target_tokens"].tolist(), "int64"
                ),
                "weights": TensorData.from_list(d.loss_fn_inputs["weights"].tolist(), "float32"),
            },
        )
        for d in batch
    ]
