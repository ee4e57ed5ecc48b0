"""Training examples for the policy losses, built from sampled tokens and their logprobs.

`importance_sampling`, `ppo` and `cispo` read, at every position of a datum, the target
token, the sampler's logprob of it and its advantage (docs/protocol.md). The prompt's
positions get advantage 0, which is what keeps them out of the loss; the completion's
positions get the sample's advantage and the sampler's logprobs, so the server can weigh
each token by its importance ratio `exp(trainer_logprob - sampler_logprob)`. In a multi-turn
sample the tokens between turns that the policy did not sample (a tool's answer) get
advantage 0 like the prompt: the datum covers every turn, and only sampled tokens train.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeAlias

from treadle import types
from treadle_cookbook.rl.groups import Group, Sample, advantages

PolicyLoss: TypeAlias = Literal["importance_sampling", "ppo", "cispo"]


def datum(sample: Sample, advantage: float) -> types.Datum:
    """The datum of one sample: input `prompt + tokens` shifted by one, as the losses expect."""
    tokens = sample.prompt_tokens + sample.tokens
    prompt_positions = len(sample.prompt_tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_list(tokens[1:], "int64"),
            "logprobs": types.TensorData.from_list(
                [0.0] * prompt_positions + list(sample.logprobs), "float32"
            ),
            "advantages": types.TensorData.from_list(
                [0.0] * prompt_positions
                + [advantage if sampled else 0.0 for sampled in sample.sampled],
                "float32",
            ),
        },
    )


def group_data(groups: Sequence[Group]) -> tuple[list[types.Datum], list[Sample]]:
    """One datum per sample of every group, and the samples in the same order."""
    data, samples = [], []
    for group in groups:
        for sample, advantage in zip(group.samples, advantages(group.rewards), strict=True):
            data.append(datum(sample, advantage))
            samples.append(sample)
    return data, samples


def sampler_trainer_kl(samples: Sequence[Sample], trainer_logprobs: Sequence[list[float]]) -> float:
    """Mean of `sampler_logprob - trainer_logprob` over all sampled tokens.

    `trainer_logprobs[i]` is datum i's per-position logprobs from forward or forward_backward
    (its last `len(samples[i].tokens)` positions are the completion's; those the policy did not
    sample are left out). Near 0 when sampler and trainer hold the same weights; it grows with
    staleness or numerical mismatch.
    """
    total, count = 0.0, 0
    for sample, trainer in zip(samples, trainer_logprobs, strict=True):
        completion = trainer[len(trainer) - len(sample.tokens) :]
        for s, t, sampled in zip(sample.logprobs, completion, sample.sampled, strict=True):
            if sampled:
                total += s - t
                count += 1
    return total / count if count else 0.0
