"""Code run in a worker process by the e2e tests: kept light, so spawning it is quick."""

from __future__ import annotations

import treadle
from treadle import types


def sample_tokens(sampler: treadle.SamplingClient, prompt: list[int], seed: int) -> list[list[int]]:
    """Sample with an unpickled SamplingClient, the way a data-loader worker would."""
    params = types.SamplingParams(max_tokens=4, seed=seed)
    result = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result(timeout=120)
    return [seq.tokens for seq in result.sequences]
