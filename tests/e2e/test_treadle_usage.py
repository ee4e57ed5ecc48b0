"""Results carry their operation's billed quantities: the `X-Treadle-Usage` header of
`/retrieve_future`, and `APIFuture.usage` in the treadle SDK (summed over chunked requests).

The server sends at most two datums per forward_backward request here, so larger batches are
split by the SDK and their usage must add up.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Iterator

import httpx
import pytest
import torch
from sqlalchemy import func, select

import treadle
from billing.tables import UsageEvent
from core.tables import Operation
from tests.e2e.treadle_data import MODEL, sft_datum
from tests.server import LiveServer, start_server
from treadle import types
from treadle.futures import APIFuture

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def chunking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from start_server(tmp_path_factory.mktemp("usage"), fwdbwd_max_chunk_len=2)


@dataclasses.dataclass
class Tenant:
    service: treadle.ServiceClient
    tenant_id: str
    key: str


@pytest.fixture
def tenant(chunking_server: LiveServer) -> Iterator[Tenant]:
    made = chunking_server.make_tenant()
    with treadle.ServiceClient(base_url=chunking_server.base_url, api_key=made.key) as client:
        yield Tenant(client, made.tenant_id, made.key)


def _ledger(server: LiveServer, tenant_id: str) -> list[tuple[str, str, int]]:
    """The tenant's usage rows as (operation type, kind, quantity)."""
    with server.database.reader() as db:
        rows = db.execute(
            select(Operation.kind, UsageEvent.kind, UsageEvent.quantity)
            .join(Operation, Operation.id == UsageEvent.operation_id)
            .where(UsageEvent.tenant_id == tenant_id)
        )
        return [(op_type, kind, int(quantity)) for op_type, kind, quantity in rows]


def _kinds(usage: dict[str, int] | None) -> dict[str, int]:
    """The usage's quantities by kind, without its cost."""
    assert usage is not None and usage["cost_micros"] >= 0
    return {kind: quantity for kind, quantity in usage.items() if kind != "cost_micros"}


def _spent(server: LiveServer, tenant_id: str) -> int:
    with server.database.reader() as db:
        return int(
            db.scalar(
                select(func.sum(UsageEvent.amount_micros)).where(UsageEvent.tenant_id == tenant_id)
            )
            or 0
        )


def _tokens(data: list[types.Datum]) -> int:
    return sum(d.model_input.length for d in data)


def test_training_results_report_their_tokens(chunking_server: LiveServer, tenant: Tenant) -> None:
    service, tenant_id = tenant.service, tenant.tenant_id
    trainer = service.create_lora_training_client(MODEL, rank=4, seed=1)
    pair = [sft_datum(0, length=10), sft_datum(1, length=13)]
    batch = [sft_datum(i, length=8 + 3 * i) for i in range(5)]  # three requests of <= 2

    single = trainer.forward_backward(pair, "cross_entropy")
    assert single.result().loss_fn_outputs
    assert _kinds(single.usage) == {"training": _tokens(pair)}
    chunked = trainer.forward_backward(batch, "cross_entropy")
    assert len(chunked.result().loss_fn_outputs) == 5
    assert _kinds(chunked.usage) == {"training": _tokens(batch)}
    step = trainer.optim_step(types.AdamParams(learning_rate=1e-3))
    step.result()
    assert step.usage == {}
    forward = trainer.forward(pair, "cross_entropy")
    forward.result()
    assert _kinds(forward.usage) == {"training": _tokens(pair)}

    training_rows = [q for op, kind, q in _ledger(chunking_server, tenant_id) if kind == "training"]
    # One row per request: 1 + 3 chunks + 1 forward; the futures' sums are the rows' sums.
    assert len(training_rows) == 5
    assert sum(training_rows) == _tokens(pair) * 2 + _tokens(batch)
    usage = service.create_rest_client().get_usage().result()
    assert {(line.kind, line.quantity) for line in usage.lines} == {
        ("training", sum(training_rows))
    }
    # What each result said it cost adds up to the ledger's amounts and the usage report's.
    spent = _spent(chunking_server, tenant_id)
    assert spent > 0
    assert sum(f.cost_micros or 0 for f in (single, chunked, forward)) == spent
    assert usage.total_micros == spent == sum(line.amount_micros for line in usage.lines)
    assert usage.total == f"{spent // 10**6}.{spent % 10**6:06d}"


def test_sample_reports_prefill_and_sampled_tokens(
    chunking_server: LiveServer, tenant: Tenant
) -> None:
    service, tenant_id = tenant.service, tenant.tenant_id
    sampler = service.create_sampling_client(base_model=MODEL)
    prompt = types.ModelInput.from_ints([30, 31, 32, 33, 34])
    future = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=6, seed=4))
    response = future.result()
    sampled = sum(len(s.tokens) for s in response.sequences)
    assert _kinds(future.usage) == {"sampling_prefill": prompt.length, "sampling_sample": sampled}
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints([40, 41, 42]))
    assert len(logprobs.result()) == 3
    assert _kinds(logprobs.usage) == {"sampling_prefill": 3, "sampling_sample": 1}

    rows = _ledger(chunking_server, tenant_id)
    assert sorted((kind, q) for _, kind, q in rows) == sorted(
        [
            ("sampling_prefill", prompt.length),
            ("sampling_sample", sampled),
            ("sampling_prefill", 3),
            ("sampling_sample", 1),
        ]
    )


def test_custom_loss_and_checkpoint_usage(chunking_server: LiveServer, tenant: Tenant) -> None:
    service, tenant_id = tenant.service, tenant.tenant_id
    trainer = service.create_lora_training_client(MODEL, rank=4, seed=2)
    data = [sft_datum(i, length=9 + i) for i in range(3)]  # two requests per pass

    def loss(
        batch: list[types.Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return -sum(lp.sum() for lp in logprobs), {}  # type: ignore[return-value]

    custom = trainer.forward_backward_custom(data, loss)
    custom.result()
    # A forward pass, then a forward_backward of the same datums, each split in two.
    assert _kinds(custom.usage) == {"training": 2 * _tokens(data)}
    save = trainer.save_state("usage")
    save.result()
    assert _kinds(save.usage) == {"checkpoint": 1}

    rows = _ledger(chunking_server, tenant_id)
    assert sorted(q for _, kind, q in rows if kind == "training") == sorted(
        2 * [_tokens(data[:2]), _tokens(data[2:])]
    )
    assert [(kind, q) for _, kind, q in rows if kind == "checkpoint"] == [("checkpoint", 1)]


def test_failed_and_pending_results_have_no_usage(
    tenant: Tenant,
) -> None:
    service = tenant.service
    trainer = service.create_lora_training_client(MODEL, rank=4, seed=3)
    broken = types.Datum(
        model_input=types.ModelInput.from_ints([10, 11, 12]),
        # cross_entropy needs weights too
        loss_fn_inputs={"target_tokens": types.TensorData.from_list([11, 12, 13], "int64")},
    )
    failed = trainer.forward_backward([broken], "cross_entropy")
    assert failed.exception(timeout=120) is not None
    assert failed.usage is None
    pending: APIFuture[None] = APIFuture(concurrent.futures.Future(), lambda: {"training": 1})
    assert pending.usage is None


def test_retrieve_future_header_is_compact_json(
    chunking_server: LiveServer, tenant: Tenant
) -> None:
    """The raw header, as any client sees it: on results only, with the op's cost; `{}` for an op
    billing nothing."""
    service, tenant_id = tenant.service, tenant.tenant_id
    trainer = service.create_lora_training_client(MODEL, rank=4, seed=4)
    pair = [sft_datum(0, length=6), sft_datum(1, length=7)]
    trainer.forward_backward(pair, "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    with chunking_server.database.reader() as db:
        ops = dict(
            db.execute(
                select(Operation.kind, Operation.id).where(Operation.tenant_id == tenant_id)
            ).all()
        )
        cost = db.scalar(
            select(UsageEvent.amount_micros).where(
                UsageEvent.operation_id == ops["forward_backward"]
            )
        )
    headers = {"X-API-Key": tenant.key}
    with httpx.Client(base_url=chunking_server.base_url, headers=headers, timeout=60) as http:
        for op_type, expected in (
            ("forward_backward", f'{{"cost_micros":{cost},"training":{_tokens(pair)}}}'),
            ("optim_step", "{}"),
        ):
            response = http.post("/api/v1/retrieve_future", json={"request_id": ops[op_type]})
            assert response.status_code == 200, response.text
            assert response.headers["X-Treadle-Usage"] == expected
