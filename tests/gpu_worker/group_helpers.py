"""Helpers of the worker group tests: the group's size and collective timeout, the scripted
training session (runs, steps, Adam settings, seeded datums and their batched ops), the
sampling requests sent to a group, a comparison of sampled results, and `start_group`, which
spawns the ranks of a gloo group on one function and waits for them."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from gpu_worker.protocol import (
    AdamParams,
    Datum,
    ForwardBackwardOp,
    LoraSpec,
    OpError,
    SampleRequest,
    SampleResult,
    SamplingParams,
)
from tests.gpu_worker.helpers import TINY, VOCAB

WORLD = 2
TIMEOUT = timedelta(seconds=60)  # every collective; a broken test fails instead of hanging
ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)
STEPS = 5
RUNS = {  # run id: loss, LoRA rank
    "ce": ("cross_entropy", 8),
    "ppo": ("ppo", 4),
    "gspo": ("gspo", 2),
}


def datums(seed: int, loss: str, n: int = 6) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        T = int(rng.integers(6, 30))
        inputs: dict[str, np.ndarray] = {"target_tokens": rng.integers(0, VOCAB, T)}
        if loss == "cross_entropy":
            inputs["weights"] = rng.uniform(0, 1, T).astype(np.float32)
        else:
            inputs["logprobs"] = -rng.uniform(5, 8, T).astype(np.float32)
            inputs["advantages"] = rng.normal(size=T).astype(np.float32)
        out.append(Datum(rng.integers(0, VOCAB, T), inputs))
    return out


def step_ops(step: int, runs: dict[str, tuple[str, int]] = RUNS) -> list[ForwardBackwardOp]:
    return [
        ForwardBackwardOp(run, datums(100 * step + i, loss), loss)
        for i, (run, (loss, _)) in enumerate(runs.items())
    ]


def lora(rank: int) -> LoraSpec:
    return LoraSpec(rank=rank, seed=rank)


def sampling_params(seed: int, max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=seed, stop=[], **kw)


SAMPLER = "sampler"  # a run loaded from one engine's checkpoint, bitwise its weights
REQUESTS = [
    SampleRequest(
        [5, 17, 300, 41, 9],
        sampling_params(11, 12, temperature=0.9, top_p=0.95),
        num_samples=4,
        base_model=TINY,
        prompt_logprobs=True,
        topk_prompt_logprobs=3,
    ),
    SampleRequest(list(range(40, 49)), sampling_params(12, 10), run_id=SAMPLER),
    SampleRequest(
        [700, 3, 81],
        sampling_params(13, 14, temperature=0.8, top_k=20),
        num_samples=3,
        run_id=SAMPLER,
    ),
    SampleRequest(
        [1, 2, 3, 4], sampling_params(14, 8, temperature=0.0), num_samples=2, base_model=TINY
    ),
]


def start_group(out: Path, main: Callable[[int, Path], None]) -> None:
    """Spawns WORLD processes running `main(rank, out)` and waits for them all (240 s at
    most), killing any left alive."""
    import torch.multiprocessing as mp

    context = mp.start_processes(main, args=(out,), nprocs=WORLD, join=False, start_method="spawn")
    try:
        deadline = time.monotonic() + 240
        while not context.join(timeout=2):
            if time.monotonic() > deadline:
                raise TimeoutError("the worker group did not finish in 240 s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(10)


def assert_same_samples(got: SampleResult | OpError, want: SampleResult) -> None:
    assert isinstance(got, SampleResult)
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
    assert [s.stop_reason for s in got.sequences] == [s.stop_reason for s in want.sequences]
    for g, w in zip(got.sequences, want.sequences, strict=True):
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=1e-5, atol=1e-5)
    assert got.usage == want.usage
    assert (got.prompt_logprobs is None) == (want.prompt_logprobs is None)
    if want.prompt_logprobs is not None and got.prompt_logprobs is not None:
        np.testing.assert_allclose(got.prompt_logprobs, want.prompt_logprobs, rtol=1e-5)
    assert (got.topk_prompt_logprobs is None) == (want.topk_prompt_logprobs is None)
    if want.topk_prompt_logprobs is not None and got.topk_prompt_logprobs is not None:
        np.testing.assert_array_equal(got.topk_prompt_logprobs[0], want.topk_prompt_logprobs[0])


def join_gloo(rank: int, out: Path) -> None:
    """Make this spawned process rank `rank` of a gloo group of WORLD ranks meeting in `out`,
    with one torch thread and TIMEOUT on every collective."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out / 'rendezvous'}",
        rank=rank,
        world_size=WORLD,
        timeout=TIMEOUT,
    )


def assert_steps_equal_one_engine(engine: Any, seen: dict[str, Any], prefix: str) -> None:
    """The group's STEPS steps of RUNS (what rank 0 saw, `seen`) against `engine` running the
    same calls on runs named `prefix` + run id: losses, usage, optimizer metrics and the
    adapters after the steps."""
    import pytest
    import torch

    from gpu_worker.protocol import ForwardBackwardResult
    from tests.gpu_worker.helpers import assert_same_loss

    names = {run: f"{prefix}{run}" for run in RUNS}
    for run, (_, rank) in RUNS.items():
        engine.create_run(names[run], TINY, lora(rank))
    try:
        for step in range(STEPS):
            ops = [ForwardBackwardOp(names[o.run_id], o.data, o.loss_fn) for o in step_ops(step)]
            for got, want in zip(seen["fb"][step], engine.forward_backward_batch(ops), strict=True):
                assert isinstance(got, ForwardBackwardResult)
                assert isinstance(want, ForwardBackwardResult)
                assert_same_loss(got, want)
                assert got.usage == want.usage
            for run, metrics in zip(RUNS, seen["optim"][step], strict=True):
                want_metrics = engine.optim_step(names[run], ADAM).metrics
                # float32 drift grows with the steps (Adam divides small gradients by small
                # moments): 1e-7 relative at the first step, near 2e-5 by the fifth
                assert metrics["grad_norm:mean"] == pytest.approx(
                    want_metrics["grad_norm:mean"], rel=1e-4
                )
                assert metrics["step:max"] == want_metrics["step:max"]
        for run in RUNS:
            want = engine.adapter(names[run]).named_tensors()
            for key, value in seen["after_steps"][run].items():
                torch.testing.assert_close(value, want[key], rtol=0, atol=1e-5)
    finally:
        for name in names.values():
            engine.remove_run(name)
