"""A whole training loop through the official tinker SDK — SFT, sampling, an RL step, save and
resume — whose losses tests compare across deployments and faults."""

from __future__ import annotations

import tinker
from tinker import types

MODEL = "treadle/tiny-1m"


def sft_datum(offset: int = 0, length: int = 24) -> types.Datum:
    tokens = [(7 * i + offset) % 500 + 10 for i in range(length + 1)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * 4 + [1.0] * (length - 4)},
    )


BATCH = [sft_datum(i, length=16) for i in range(3)]
ADAM = types.AdamParams(learning_rate=5e-3)


def scenario(
    base_url: str, key: str, steps: int, on_step: object = None, seed: int = 11
) -> list[float]:
    """SFT steps, then an RL step on sampled data, then save and resume with the optimizer;
    returns the losses. `on_step(step, run_id)` is called after each SFT step."""
    client = tinker.ServiceClient(base_url=base_url, api_key=key)
    trainer = client.create_lora_training_client(base_model=MODEL, rank=4, seed=seed).result()
    losses = []
    for step in range(steps):
        losses.append(trainer.forward_backward(BATCH, "cross_entropy").result().metrics["loss:sum"])
        trainer.optim_step(ADAM).result()
        if callable(on_step):
            on_step(step, trainer.model_id)
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([15, 16, 17])
    sample = sampler.sample(
        prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=4, seed=3)
    ).result()
    rl = [
        types.Datum(
            model_input=types.ModelInput.from_ints([*prompt.to_ints(), *s.tokens][:-1]),
            loss_fn_inputs={
                "target_tokens": [*prompt.to_ints(), *s.tokens][1:],
                "logprobs": [0.0, 0.0, *(s.logprobs or [])],
                "advantages": [0.0, 0.0] + [1.0] * len(s.tokens),
            },
        )
        for s in sample.sequences
    ]
    losses.append(trainer.forward_backward(rl, "importance_sampling").result().metrics["loss:sum"])
    trainer.optim_step(ADAM).result()
    path = trainer.save_state("done").result().path
    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    losses.append(resumed.forward(BATCH, "cross_entropy").result().metrics["loss:sum"])
    client.close("success").result(timeout=60)
    return losses
