"""Shared fixtures for the engine tests: one engine on the ~1M tiny model, 1 torch thread."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import pytest
import torch

from gpu_worker.engine import Engine, EngineSettings

TINY = "treadle/tiny-1m"
VOCAB = 1024


@pytest.fixture(scope="session")
def engine() -> Engine:
    # TREADLE_TEST_DEVICE=cuda runs the same suite on a GPU (in fp32, so references match).
    device = os.environ.get("TREADLE_TEST_DEVICE", "cpu")
    return Engine(
        EngineSettings(
            device=device,
            precision="fp32",
            num_threads=1,
            max_lora_rank=64,
            aliases={"Qwen/Qwen3-8B": TINY},
        )
    )


def randomize_adapter(engine: Engine, run_id: str, seed: int, std: float = 0.05) -> None:
    """Give B non-zero values so every LoRA weight gets a gradient."""
    gen = torch.Generator().manual_seed(seed)
    adapter = engine._runs[run_id].adapter
    with torch.no_grad():
        for a, b in adapter.weights.values():
            a.copy_(torch.randn(a.shape, generator=gen) * std)
            b.copy_(torch.randn(b.shape, generator=gen) * std)


def adapter_grads(engine: Engine, run_id: str) -> dict[str, torch.Tensor]:
    adapter = engine._runs[run_id].adapter
    out = {}
    for name, (a, b) in adapter.weights.items():
        for key, p in ((f"{name}.A", a), (f"{name}.B", b)):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            out[key] = grad.detach().to("cpu", torch.float32).clone()
    return out


def rng_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, n).astype(np.int64)
