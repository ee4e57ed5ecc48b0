"""Helpers of the engine tests: the tiny model, random tokens, adapter weights and gradients,
a training run that is removed afterwards, and single ops sent the way the worker host sends
them (through the engine's batched methods)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypeVar

import numpy as np
import torch

from gpu_worker.engine import Engine
from gpu_worker.protocol import (
    Datum,
    ForwardBackwardOp,
    ForwardBackwardResult,
    LoraSpec,
    OpError,
    SampleRequest,
    SampleResult,
    SamplingParams,
    UserInputError,
)

TINY = "treadle/tiny-1m"
VOCAB = 1024

R = TypeVar("R")


@contextlib.contextmanager
def training_run(
    engine: Engine,
    run_id: str,
    lora: LoraSpec,
    *,
    base_model: str = TINY,
    randomize_seed: int | None = None,
    std: float = 0.05,
) -> Iterator[str]:
    """A run on `engine` for the duration of the block (its adapter randomized when
    `randomize_seed` is given); yields its id and removes it afterwards."""
    engine.create_run(run_id, base_model, lora)
    try:
        if randomize_seed is not None:
            randomize_adapter(engine, run_id, seed=randomize_seed, std=std)
        yield run_id
    finally:
        engine.remove_run(run_id)


def randomize_adapter(engine: Engine, run_id: str, seed: int, std: float = 0.05) -> None:
    """Give B non-zero values so every LoRA weight gets a gradient."""
    gen = torch.Generator().manual_seed(seed)
    adapter = engine.adapter(run_id)
    with torch.no_grad():
        for a, b in adapter.weights.values():
            a.copy_(torch.randn(a.shape, generator=gen) * std)
            b.copy_(torch.randn(b.shape, generator=gen) * std)


def adapter_grads(engine: Engine, run_id: str) -> dict[str, torch.Tensor]:
    adapter = engine.adapter(run_id)
    out = {}
    for name, (a, b) in adapter.weights.items():
        for key, p in ((f"{name}.A", a), (f"{name}.B", b)):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            out[key] = grad.detach().to("cpu", torch.float32).clone()
    return out


def rng_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, n).astype(np.int64)


def _succeeded(result: R | OpError) -> R:
    if isinstance(result, OpError):
        raise (UserInputError if result.category == "user" else RuntimeError)(result.message)
    return result


def forward(
    engine: Engine,
    run_id: str,
    data: list[Datum],
    loss_fn: str = "cross_entropy",
    loss_fn_config: dict[str, float] | None = None,
) -> ForwardBackwardResult:
    """A forward-only op alone in its batch; a refused op raises its error."""
    op = ForwardBackwardOp(run_id, data, loss_fn, loss_fn_config, forward_only=True)
    (result,) = engine.forward_backward_batch([op])
    return _succeeded(result)


def sample(engine: Engine, request: SampleRequest) -> SampleResult:
    """One request alone in its batch; a refused request raises its error."""
    (result,) = engine.sample_batch([request])
    return _succeeded(result)


def prompt_scores(
    engine: Engine,
    tokens: list[int],
    *,
    run_id: str | None = None,
    base_model: str | None = None,
    topk: int = 0,
) -> SampleResult:
    """The logprob of each token given those before it (and the top-k), asked for as the SDK's
    compute_logprobs asks: a one-token sample with prompt logprobs."""
    request = SampleRequest(
        prompt=tokens,
        params=SamplingParams(max_tokens=1, seed=0),
        run_id=run_id,
        base_model=base_model,
        prompt_logprobs=True,
        topk_prompt_logprobs=topk,
    )
    return sample(engine, request)


def next_token_logprobs(
    engine: Engine,
    tokens: list[int],
    *,
    run_id: str | None = None,
    base_model: str | None = None,
    vocab: int = VOCAB,
) -> np.ndarray:
    """(T-1, V): the log-softmax over the vocabulary after each of `tokens` but the last, read
    from the engine's top-k prompt logprobs with k the whole vocabulary."""
    scored = prompt_scores(engine, tokens, run_id=run_id, base_model=base_model, topk=vocab)
    assert scored.topk_prompt_logprobs is not None
    ids_TK, logprobs_TK = scored.topk_prompt_logprobs
    out_TV = np.full((len(tokens) - 1, vocab), np.nan, dtype=np.float32)
    np.put_along_axis(out_TV, ids_TK[1:], logprobs_TK[1:], axis=1)  # row 0 predicts nothing
    assert not np.isnan(out_TV).any()
    return out_TV


def assert_same_loss(got: ForwardBackwardResult, want: ForwardBackwardResult) -> None:
    """`loss:sum` equal to 1e-6 of the size of its terms (Σ|elementwise loss|), and per-datum
    logprobs to 1e-5: results summed in another order (other passes, other ranks) differ by
    float32 rounding, which scales with the terms, not with a total where they cancel (an RL
    loss over advantages of both signs)."""
    size = sum(float(np.abs(out["elementwise_loss"]).sum()) for out in want.loss_fn_outputs)
    assert abs(got.metrics["loss:sum"] - want.metrics["loss:sum"]) <= 1e-6 * size
    for g, w in zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(g["logprobs"], w["logprobs"], rtol=1e-5, atol=1e-6)
