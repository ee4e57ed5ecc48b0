"""Preference losses (DPO, KTO) computed on this machine through `forward_backward_custom`.

The server computes per-token logprobs; these losses turn them into sequence logprobs of the
reply (the datum's weights are the reply's mask) and compare them with a frozen reference
model's, which `reference_logprobs` computes once from a sampling client of the initial
weights. A batch is a list of pair datums, each pair's chosen reply then its rejected one
(`pair_datums`), with the reference values in the same order.

The implicit reward of a reply is `policy logprob - reference logprob`; the margin of a pair
is the chosen reply's reward minus the rejected one's. Training must push margins up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from treadle import SamplingClient, TrainingClient
from treadle.types import Datum, ModelInput
from treadle_cookbook.data import Preference
from treadle_cookbook.renderers import Renderer

LossFn = Callable[[list[Datum], list[Any]], tuple[Any, dict[str, float]]]
"""What `forward_backward_custom` calls: (data, per-token logprob tensors) -> (loss, metrics)."""


def pair_datums(renderer: Renderer, pairs: Sequence[Preference]) -> list[Datum]:
    """Two datums per pair, chosen then rejected, weight 1 on the reply's tokens only."""
    datums = []
    for pair in pairs:
        datums.append(renderer.reply(pair.prompt, pair.chosen).to_datum())
        datums.append(renderer.reply(pair.prompt, pair.rejected).to_datum())
    return datums


def reference_logprobs(sampling_client: SamplingClient, datums: Sequence[Datum]) -> list[float]:
    """Each datum's reply logprob under the sampling client's weights (all requests sent, then
    awaited)."""
    futures = []
    for datum in datums:
        targets = datum.loss_fn_inputs["target_tokens"].tolist()
        tokens = ModelInput.from_ints([*datum.model_input.to_ints(), targets[-1]])
        futures.append(sampling_client.compute_logprobs(tokens))
    values = []
    for datum, future in zip(datums, futures, strict=True):
        weights = datum.loss_fn_inputs["weights"].tolist()
        # Entry j + 1 is the logprob of target j (entry 0 is the first token's: None).
        token_logprobs = future.result()[1:]
        values.append(sum(w * (lp or 0.0) for w, lp in zip(weights, token_logprobs, strict=True)))
    return values


def policy_logprobs(training_client: TrainingClient, datums: Sequence[Datum]) -> list[float]:
    """Each datum's reply logprob under the run's current weights (a forward pass only)."""
    output = training_client.forward(list(datums), "cross_entropy").result()
    return [
        sum(
            w * lp
            for w, lp in zip(
                datum.loss_fn_inputs["weights"].tolist(), out["logprobs"].tolist(), strict=True
            )
        )
        for datum, out in zip(datums, output.loss_fn_outputs, strict=True)
    ]


def margins(policy: Sequence[float], reference: Sequence[float]) -> list[float]:
    """Each pair's reward margin, from interleaved (chosen, rejected) sequence logprobs."""
    rewards = [p - r for p, r in zip(policy, reference, strict=True)]
    return [chosen - rejected for chosen, rejected in zip(rewards[::2], rewards[1::2], strict=True)]


def dpo_loss(reference: Sequence[float], beta: float) -> LossFn:
    """DPO: `-log sigmoid(beta * margin)`, averaged over the batch's pairs.

    Args:
        reference: the batch's reference logprobs, in the order of its datums.
        beta: how far the policy may move from the reference; larger is stricter.

    Metrics: `dpo_margin` (mean margin before the update) and `dpo_accuracy` (share of pairs
    with a positive margin).
    """

    def loss_fn(data: list[Datum], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
        rewards = _rewards(data, logprobs, reference)
        margin = rewards[0::2] - rewards[1::2]
        loss = -F.logsigmoid(beta * margin).mean()
        seen = margin.detach()
        return loss, {
            "dpo_margin": float(seen.mean()),
            "dpo_accuracy": float((seen > 0).float().mean()),
        }

    return loss_fn


def kto_loss(
    reference: Sequence[float],
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> LossFn:
    """KTO on a pair batch: chosen replies are desirable, rejected ones undesirable.

    Each reply's reward is compared with a reference point `z`, the batch's mean reward
    clamped at 0 and detached (the paper estimates it from mismatched prompt/reply pairs; the
    batch mean is a simpler estimate of the same KL term). Desirable replies lose
    `1 - sigmoid(beta * (reward - z))`, undesirable ones `1 - sigmoid(beta * (z - reward))`,
    weighted and averaged.

    Metrics: `kto_chosen_reward`, `kto_rejected_reward` and `kto_margin`, their difference.
    """

    def loss_fn(data: list[Datum], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
        rewards = _rewards(data, logprobs, reference)
        chosen, rejected = rewards[0::2], rewards[1::2]
        z = rewards.detach().mean().clamp(min=0)
        desirable = desirable_weight * (1 - torch.sigmoid(beta * (chosen - z)))
        undesirable = undesirable_weight * (1 - torch.sigmoid(beta * (z - rejected)))
        loss = torch.cat([desirable, undesirable]).mean()
        chosen_seen, rejected_seen = chosen.detach(), rejected.detach()
        return loss, {
            "kto_chosen_reward": float(chosen_seen.mean()),
            "kto_rejected_reward": float(rejected_seen.mean()),
            "kto_margin": float((chosen_seen - rejected_seen).mean()),
        }

    return loss_fn


def _rewards(data: list[Datum], logprobs: list[Any], reference: Sequence[float]) -> Any:
    """Policy minus reference reply logprob per datum, a 1-D tensor with gradients."""
    if len(data) % 2 or len(reference) != len(data):
        raise ValueError(
            f"a preference batch is (chosen, rejected) pairs with one reference value per datum; "
            f"got {len(data)} datums and {len(reference)} reference values"
        )
    sequence = torch.stack(
        [
            (logprob * datum.loss_fn_inputs["weights"].to_torch()).sum()
            for datum, logprob in zip(data, logprobs, strict=True)
        ]
    )
    return sequence - torch.tensor(list(reference), dtype=sequence.dtype)
