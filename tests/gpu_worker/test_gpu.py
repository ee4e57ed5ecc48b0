"""CUDA checks: the bf16 engine agrees with the fp32 engine on the same GPU, and batches runs.

The rest of the suite runs on a GPU too with TREADLE_TEST_DEVICE=cuda (fp32).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from gpu_worker.engine import Engine, EngineSettings
from gpu_worker.protocol import (
    AdamParams,
    Datum,
    ForwardBackwardOp,
    LoraSpec,
    OpError,
    SampleRequest,
    SamplingParams,
)
from tests.gpu_worker.helpers import adapter_grads, rng_tokens, sample, training_run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def data(seed: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    return [
        Datum(
            rng_tokens(rng, n),
            {"target_tokens": rng_tokens(rng, n), "weights": np.ones(n, np.float32)},
        )
        for n in (31, 64, 7)
    ]


@pytest.fixture(scope="module")
def engines():
    return (
        Engine(EngineSettings(device="cuda", precision="fp32")),
        Engine(EngineSettings(device="cuda", precision="auto")),
    )


def test_bf16_matches_fp32_within_bf16_tolerance(engines):
    fp32, bf16 = engines
    assert bf16.weight_dtype == torch.bfloat16
    with contextlib.ExitStack() as stack:
        for e in engines:
            stack.enter_context(training_run(e, "g", LoraSpec(rank=8, seed=1), randomize_seed=2))
        a = fp32.forward_backward("g", data(0))
        b = bf16.forward_backward("g", data(0))
        assert b.metrics["loss:sum"] == pytest.approx(a.metrics["loss:sum"], rel=2e-2)
        ga, gb = adapter_grads(fp32, "g"), adapter_grads(bf16, "g")
        cos = torch.nn.functional.cosine_similarity(
            torch.cat([g.flatten() for g in ga.values()]),
            torch.cat([g.flatten() for g in gb.values()]),
            dim=0,
        )
        assert float(cos) > 0.98
        for e in engines:
            e.optim_step("g", AdamParams(learning_rate=1e-3))
            res = sample(
                e,
                SampleRequest(
                    prompt=[1, 2, 3],
                    run_id="g",
                    num_samples=4,
                    params=SamplingParams(max_tokens=8, seed=3, stop=[]),
                ),
            )
            again = sample(
                e,
                SampleRequest(
                    prompt=[1, 2, 3],
                    run_id="g",
                    num_samples=4,
                    params=SamplingParams(max_tokens=8, seed=3, stop=[]),
                ),
            )
            assert [s.tokens for s in res.sequences] == [s.tokens for s in again.sequences]


def test_mixed_ranks_on_gpu(engines):
    fp32, _ = engines
    ids = list(range(4))
    with contextlib.ExitStack() as stack:
        for i, rank in enumerate((1, 8, 32, 64)):
            for prefix in ("alone", "batch"):
                spec = LoraSpec(rank=rank, seed=i)
                stack.enter_context(training_run(fp32, f"{prefix}{i}", spec, randomize_seed=10 + i))
        alone = [fp32.forward_backward(f"alone{i}", data(i)) for i in ids]
        batched = fp32.forward_backward_batch(
            [ForwardBackwardOp(f"batch{i}", data(i)) for i in ids]
        )
        for i, a, b in zip(ids, alone, batched, strict=True):
            assert not isinstance(b, OpError)
            assert b.metrics["loss:sum"] == pytest.approx(a.metrics["loss:sum"], rel=1e-4)
            ga, gb = adapter_grads(fp32, f"alone{i}"), adapter_grads(fp32, f"batch{i}")
            for key in ga:
                torch.testing.assert_close(gb[key], ga[key], atol=1e-4, rtol=1e-3)
