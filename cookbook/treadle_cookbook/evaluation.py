"""Measuring a model without training it: held-out loss, and greedy exact match.

`held_out_loss` runs a forward pass only (no gradients accumulate, the optimizer is not
touched), so it can run between any two steps of a recipe. `exact_match` samples greedily
(temperature 0), so a score reflects the weights, not the draw; RL recipes use it for their
held-out accuracy with their own notion of a correct answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from treadle import SamplingClient, TrainingClient
from treadle.types import Datum, ForwardBackwardOutput, ModelInput, SamplingParams


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


def greedy_completions(
    sampling_client: SamplingClient,
    prompts: Sequence[ModelInput],
    *,
    max_tokens: int,
    stop: list[int] | None = None,
) -> list[list[int]]:
    """One greedy continuation per prompt (all requests sent, then awaited)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop)
    futures = [sampling_client.sample(prompt, 1, params) for prompt in prompts]
    return [future.result().sequences[0].tokens for future in futures]


def exact_match(
    sampling_client: SamplingClient,
    prompts: Sequence[ModelInput],
    answers: Sequence[str],
    decode: Callable[[list[int]], str],
    *,
    max_tokens: int,
    stop: list[int] | None = None,
) -> float:
    """The share of prompts whose greedy completion, decoded and stripped, equals its answer.

    Raises:
        ValueError: prompts and answers differ in number, or there are none.
    """
    if not prompts or len(prompts) != len(answers):
        raise ValueError(f"need as many answers as prompts, got {len(answers)} for {len(prompts)}")
    completions = greedy_completions(sampling_client, prompts, max_tokens=max_tokens, stop=stop)
    hits = sum(
        decode(tokens).strip() == answer.strip()
        for tokens, answer in zip(completions, answers, strict=True)
    )
    return hits / len(prompts)
