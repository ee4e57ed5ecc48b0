"""Measuring a model without training it: held-out loss.

`held_out_loss` runs a forward pass only (no gradients accumulate, the optimizer is not
touched), so it can run between any two steps of a recipe. Held-out accuracy of sampled
answers is `treadle_cookbook.rl.rollouts.greedy_accuracy`, which grades greedy completions
with the task's own notion of a correct answer.
"""

from __future__ import annotations

from collections.abc import Sequence

from treadle import TrainingClient
from treadle.types import Datum, ForwardBackwardOutput


def mean_token_loss(data: Sequence[Datum], output: ForwardBackwardOutput) -> float:
    """The weighted mean negative log-likelihood per trained token of a cross-entropy pass.

    Raises:
        ValueError: no datum has a nonzero weight (nothing was measured).
    """
    total = weight_sum = 0.0
    for datum, out in zip(data, output.loss_fn_outputs, strict=True):
        weights = datum.loss_fn_inputs["weights"].dense_values()
        logprobs = out["logprobs"].dense_values()
        total -= sum(w * lp for w, lp in zip(weights, logprobs, strict=True))
        weight_sum += sum(weights)
    if weight_sum == 0:
        raise ValueError("every weight is 0: the data has no trained tokens to measure")
    return total / weight_sum


def held_out_loss(training_client: TrainingClient, data: Sequence[Datum]) -> float:
    """`mean_token_loss` of `data` under the run's current weights, by a forward pass."""
    output = training_client.forward(list(data), "cross_entropy").result()
    return mean_token_loss(data, output)
