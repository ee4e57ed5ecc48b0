"""Sampling a training run's current weights (`live:<run id>`) through the official tinker SDK
and the treadle SDK: a live sampler follows the run's optimizer steps while a saved checkpoint
stays put, matches a sampler checkpoint saved at the same step, looks missing to another tenant,
and stops with a clear error once the run's session ended."""

from __future__ import annotations

import math

import pytest
import tinker
from sqlalchemy import func, select
from tinker import types

import treadle
from billing.tables import UsageEvent
from tests.scenarios import ADAM, BATCH, MODEL
from tests.server import LiveServer

pytestmark = pytest.mark.e2e

PROMPT = types.ModelInput.from_ints([11, 12, 13, 14, 15, 16])


def _logprobs(client: tinker.SamplingClient) -> list[float]:
    values = client.compute_logprobs(PROMPT).result(timeout=120)
    return [v for v in values if v is not None]


def _step(trainer: tinker.TrainingClient) -> None:
    trainer.forward_backward(BATCH, "cross_entropy").result(timeout=120)
    trainer.optim_step(ADAM).result(timeout=120)


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        math.isclose(x, y, abs_tol=1e-5) for x, y in zip(a, b, strict=True)
    )


def _sampling_usage(server: LiveServer, tenant_id: str) -> int:
    with server.database.reader() as db:
        return (
            db.scalar(
                select(func.count())
                .select_from(UsageEvent)
                .where(UsageEvent.tenant_id == tenant_id, UsageEvent.kind == "sampling_prefill")
            )
            or 0
        )


def test_tinker_live_sampler_follows_the_run_and_ends_with_its_session(
    live_server: LiveServer,
) -> None:
    owner_tenant, other_tenant = live_server.make_tenant(), live_server.make_tenant()
    owner = tinker.ServiceClient(base_url=live_server.base_url, api_key=owner_tenant.key)
    watcher = tinker.ServiceClient(base_url=live_server.base_url, api_key=owner_tenant.key)
    other = tinker.ServiceClient(base_url=live_server.base_url, api_key=other_tenant.key)
    trainer = owner.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
    run_id = trainer.get_info().model_id
    _step(trainer)

    # Another session of the same tenant samples the run live (as a chat page would).
    live = watcher.create_sampling_client(model_path=f"tinker://live:{run_id}").result()
    saved_path = trainer.save_weights_for_sampler("step1").result(timeout=120).path
    saved = owner.create_sampling_client(model_path=saved_path).result()
    at_step1 = _logprobs(live)
    assert _close(at_step1, _logprobs(saved))
    metered = _sampling_usage(live_server, owner_tenant.tenant_id)
    assert metered >= 2

    _step(trainer)
    _step(trainer)
    at_step3 = _logprobs(live)
    assert not _close(at_step3, at_step1)  # the live sampler follows the steps
    assert _close(_logprobs(saved), at_step1)  # the checkpoint does not
    saved3 = owner.create_sampling_client(
        model_path=trainer.save_weights_for_sampler("step3").result(timeout=120).path
    ).result()
    assert _close(_logprobs(saved3), at_step3)
    assert _sampling_usage(live_server, owner_tenant.tenant_id) > metered

    sampled = live.sample(PROMPT, 2, types.SamplingParams(max_tokens=3, seed=1)).result(timeout=120)
    assert len(sampled.sequences) == 2

    # Another tenant's run looks exactly like a missing one.
    with pytest.raises(tinker.NotFoundError, match="not found"):
        other.create_sampling_client(model_path=f"tinker://live:{run_id}").result()
    with pytest.raises(tinker.NotFoundError, match="not found"):
        other.create_sampling_client(model_path=f"tinker://live:{run_id}x").result()

    # Once the run's session ended, the run holds no weights: sampling it says so.
    owner.close("success").result(timeout=60)
    with pytest.raises(tinker.UnprocessableEntityError, match="its session ended"):
        live.compute_logprobs(PROMPT).result(timeout=120)
    with pytest.raises(tinker.UnprocessableEntityError, match="its session ended"):
        watcher.create_sampling_client(model_path=f"tinker://live:{run_id}").result()
    watcher.close("success").result(timeout=60)
    other.close("success").result(timeout=60)


def test_treadle_live_sampling_client(live_server: LiveServer) -> None:
    prompt = treadle.types.ModelInput.from_ints(PROMPT.to_ints())
    batch = [
        treadle.types.Datum(
            model_input=treadle.types.ModelInput.from_ints(d.model_input.to_ints()),
            loss_fn_inputs={k: v.tolist() for k, v in d.loss_fn_inputs.items()},
        )
        for d in BATCH
    ]
    key = live_server.make_tenant().key
    with treadle.ServiceClient(base_url=live_server.base_url, api_key=key) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, seed=5)
        live = trainer.live_sampling_client()
        assert live.model_path == f"live:{trainer.model_id}"
        before = [v for v in live.compute_logprobs(prompt).result(timeout=120) if v is not None]
        for _ in range(2):
            trainer.forward_backward(batch, "cross_entropy").result(timeout=120)
            trainer.optim_step(treadle.types.AdamParams(learning_rate=5e-3)).result(timeout=120)
        after = [v for v in live.compute_logprobs(prompt).result(timeout=120) if v is not None]
        assert not _close(before, after)
        again = service.create_sampling_client(model_path=f"live:{trainer.model_id}")
        assert _close(
            [v for v in again.compute_logprobs(prompt).result(timeout=120) if v is not None],
            after,
        )
