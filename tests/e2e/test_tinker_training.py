"""The official tinker SDK trains, samples and checkpoints against an embedded server."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.scenarios import MODEL, sft_datum
from tests.server import LiveServer, start_server

pytestmark = pytest.mark.e2e


@pytest.fixture
def service(live_server: LiveServer) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(
        base_url=live_server.base_url, api_key=live_server.make_tenant().key
    )
    yield client
    client.close("success").result(timeout=60)


def test_sft_loop_loss_falls(service: tinker.ServiceClient) -> None:
    trainer = service.create_lora_training_client(base_model=MODEL, rank=8, seed=3).result()
    batch = [sft_datum(i) for i in range(4)]
    losses = []
    for _ in range(6):
        fwd = trainer.forward_backward(batch, "cross_entropy")
        step = trainer.optim_step(types.AdamParams(learning_rate=5e-3))
        losses.append(fwd.result().metrics["loss:sum"])
        assert "grad_norm:mean" in (step.result().metrics or {})
    assert losses[-1] < 0.7 * losses[0], losses
    info = trainer.get_info()
    assert info.model_data.model_name == MODEL and info.lora_rank == 8


def test_rl_step_with_sampling_and_policy_losses(service: tinker.ServiceClient) -> None:
    trainer = service.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([11, 12, 13, 14])
    result = sampler.sample(
        prompt, num_samples=4, sampling_params=types.SamplingParams(max_tokens=6, seed=5)
    ).result()
    assert len(result.sequences) == 4
    for loss_fn in ("importance_sampling", "ppo", "cispo"):
        data = []
        for i, seq in enumerate(result.sequences):
            assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
            tokens = prompt.to_ints() + seq.tokens
            n = len(tokens) - 1
            advantage = 1.0 if i % 2 == 0 else -1.0
            pad = len(prompt.to_ints()) - 1
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": [0.0] * pad + list(seq.logprobs),
                        "advantages": [0.0] * pad + [advantage] * (n - pad),
                    },
                )
            )
        out = trainer.forward_backward(data, loss_fn).result()
        trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        assert "loss:sum" in out.metrics
        assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == [
            len(d.model_input.to_ints()) for d in data
        ]


def test_custom_dpo_style_loss(service: tinker.ServiceClient) -> None:
    trainer = service.create_lora_training_client(base_model=MODEL, rank=4, seed=2).result()
    chosen, rejected = sft_datum(1), sft_datum(2)

    def dpo_loss(
        data: list[types.Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        weights = [torch.tensor(d.loss_fn_inputs["weights"].tolist()) for d in data]
        margin = (logprobs[0] * weights[0]).sum() - (logprobs[1] * weights[1]).sum()
        loss = -torch.nn.functional.logsigmoid(0.1 * margin)
        return loss, {"margin": float(margin.detach())}

    first = trainer.forward_backward_custom([chosen, rejected], dpo_loss).result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    second = trainer.forward_backward_custom([chosen, rejected], dpo_loss).result()
    assert second.metrics["margin"] > first.metrics["margin"]


def test_compute_logprobs_matches_forward(service: tinker.ServiceClient) -> None:
    trainer = service.create_lora_training_client(base_model=MODEL, rank=4, seed=4).result()
    datum = sft_datum(3, length=12)
    trainer.forward_backward([datum], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    forward = (
        trainer.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    )
    sampler = trainer.save_weights_and_get_sampling_client().result()
    tokens = [*datum.model_input.to_ints(), datum.loss_fn_inputs["target_tokens"].tolist()[-1]]
    prompt_logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert prompt_logprobs[0] is None
    np.testing.assert_allclose(prompt_logprobs[1:], forward, rtol=1e-4, atol=1e-4)


def test_resume_with_optimizer_reproduces_the_next_loss(service: tinker.ServiceClient) -> None:
    batch = [sft_datum(i) for i in range(3)]
    trainer = service.create_lora_training_client(base_model=MODEL, rank=8, seed=7).result()
    for _ in range(3):
        trainer.forward_backward(batch, "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=3e-3))
    path = trainer.save_state("mid").result().path
    assert path.endswith("/weights/mid")
    trainer.forward_backward(batch, "cross_entropy")
    trainer.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    expected = trainer.forward(batch, "cross_entropy").result().metrics["loss:sum"]

    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    resumed.forward_backward(batch, "cross_entropy")
    resumed.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    actual = resumed.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    assert actual == pytest.approx(expected, rel=1e-5)


def test_named_sampler_checkpoint(service: tinker.ServiceClient) -> None:
    trainer = service.create_lora_training_client(base_model=MODEL, rank=4, seed=5).result()
    trainer.forward_backward([sft_datum(0)], "cross_entropy")
    trainer.optim_step(types.AdamParams(learning_rate=1e-2))
    path = trainer.save_weights_for_sampler("policy-v1").result().path
    assert path.endswith("/sampler_weights/policy-v1")
    sampler = service.create_sampling_client(model_path=path).result()
    params = types.SamplingParams(max_tokens=5, seed=11, temperature=1.0)
    prompt = types.ModelInput.from_ints([20, 21, 22])
    first = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
    again = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    assert all(s.stop_reason == "length" and len(s.tokens) == 5 for s in first.sequences)


def test_chunked_out_of_order_batch_equals_one_request(
    tmp_path_factory: pytest.TempPathFactory, live_server: LiveServer
) -> None:
    """The SDK sends chunks 2..n before chunk 1; gradients accumulate in seq order all the same."""
    batch = [sft_datum(i) for i in range(5)]

    def train(server: LiveServer) -> tuple[float, float]:
        client = tinker.ServiceClient(base_url=server.base_url, api_key=server.make_tenant().key)
        try:
            trainer = client.create_lora_training_client(base_model=MODEL, rank=4, seed=9).result()
            before = trainer.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"]
            trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            after = trainer.forward(batch, "cross_entropy").result().metrics["loss:sum"]
            return before, after
        finally:
            client.close("success").result(timeout=60)

    chunked_server = start_server(tmp_path_factory.mktemp("chunked"), fwdbwd_max_chunk_len=2)
    chunked = train(next(chunked_server))
    chunked_server.close()
    whole = train(live_server)
    assert chunked == pytest.approx(whole, rel=1e-5)
