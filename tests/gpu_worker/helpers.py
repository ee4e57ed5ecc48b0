"""Helpers of the engine tests: the tiny model, random tokens, adapter weights and gradients."""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.engine import Engine

TINY = "treadle/tiny-1m"
VOCAB = 1024


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
