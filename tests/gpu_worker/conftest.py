"""Shared fixtures for the engine tests: one engine on the ~1M tiny model, 1 torch thread."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest

from gpu_worker.engine import Engine, EngineSettings
from tests.gpu_worker.helpers import TINY


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
