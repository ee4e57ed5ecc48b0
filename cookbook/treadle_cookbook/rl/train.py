"""One policy-gradient optimizer step over several forward_backward sub-batches.

A large batch of datums is sent as `sub_batches` forward_backward calls whose gradients add
up, then one optim_step applies them: the same update as one big call, with smaller requests
and less memory per pass on the server. All calls are submitted before any is awaited, so
they run back to back on the server.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from treadle import TrainingClient, types
from treadle_cookbook.rl.datums import PolicyLoss, group_data, sampler_trainer_kl
from treadle_cookbook.rl.groups import Group, advantages

T = TypeVar("T")


def split(items: Sequence[T], parts: int) -> list[list[T]]:
    """`items` in `parts` contiguous chunks whose sizes differ by at most one (none empty)."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    parts = min(parts, len(items))
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        chunks.append(list(items[start:end]))
        start = end
    return chunks


async def train_step(
    client: TrainingClient,
    groups: Sequence[Group],
    *,
    loss_fn: PolicyLoss,
    adam: types.AdamParams,
    sub_batches: int,
) -> dict[str, float]:
    """Train on every sample of `groups` with one optim_step; return the step's metrics.

    Metrics: `kl_sampler_trainer` (see `sampler_trainer_kl`; the trainer's logprobs come from
    the forward passes of this step, before its update), `loss` (the loss summed over
    sub-batches), `datums`, `sub_batches` (the number of forward_backward calls) and
    `advantage_abs_mean` (the mean |advantage| of the samples: 0 when nothing was learned from).
    """
    if sub_batches < 1:
        raise ValueError(f"sub_batches must be at least 1, got {sub_batches}")
    data, samples = group_data(groups)
    trained = [a for group in groups for a in advantages(group.rewards)]
    chunks = split(data, sub_batches)
    passes = [await client.forward_backward_async(chunk, loss_fn) for chunk in chunks]
    step = await client.optim_step_async(adam)
    outputs = [await p for p in passes]
    optim = await step
    trainer_logprobs = [
        [float(x) for x in row["logprobs"].tolist()]
        for out in outputs
        for row in out.loss_fn_outputs
    ]
    metrics = {
        "kl_sampler_trainer": sampler_trainer_kl(samples, trainer_logprobs),
        "loss": sum(out.metrics.get("loss:sum", 0.0) for out in outputs),
        "datums": float(len(data)),
        "sub_batches": float(len(chunks)),
        "advantage_abs_mean": sum(map(abs, trained)) / len(trained),
    }
    if optim.metrics and "grad_norm:mean" in optim.metrics:
        metrics["grad_norm"] = optim.metrics["grad_norm:mean"]
    return metrics
