"""The engine's seams for worker groups, on one device: validation apart from execution, a
gradient reduction before the optimizer step, a state loaded from tensors in memory, and a
sampling request checked once and sampled in shares of its sample indices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker import checkpoint
from gpu_worker.protocol import (
    AdamParams,
    Datum,
    ForwardBackwardOp,
    LoraSpec,
    SampleRequest,
    SampleResult,
    SamplingParams,
    UserInputError,
)
from gpu_worker.validation import CheckedOp
from tests.gpu_worker.helpers import TINY, rng_tokens, training_run

pytestmark = pytest.mark.unit

CLIP = AdamParams(learning_rate=1e-2, grad_clip_norm=1e-3)


def batch(seed: int, n: int = 3) -> list[Datum]:
    rng = np.random.default_rng(seed)
    return [
        Datum(
            rng_tokens(rng, 12),
            {"target_tokens": rng_tokens(rng, 12), "weights": np.ones(12, np.float32)},
        )
        for _ in range(n)
    ]


def weights(engine, run: str) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.adapter(run).parameters()]


def test_prepare_then_execute_equals_the_batched_call(engine):
    lora = LoraSpec(rank=4, seed=3)
    with (
        training_run(engine, "seam-a", lora, randomize_seed=1) as a,
        training_run(engine, "seam-b", lora, randomize_seed=1) as b,
    ):
        ops = [ForwardBackwardOp(a, batch(0)), ForwardBackwardOp("nobody", batch(1))]
        prepared = engine.prepare_batch(ops)
        assert isinstance(prepared[0], CheckedOp)
        assert prepared[1].category == "user"  # an unknown run is refused, not raised
        assert all(p.grad is None for p in engine.adapter(a).parameters())  # no side effect
        split = engine.execute_checked(prepared)
        (whole,) = engine.forward_backward_batch([ForwardBackwardOp(b, batch(0))])
        assert split[1] is prepared[1]
        assert split[0].metrics == whole.metrics
        for x, y in zip(
            engine.adapter(a).parameters(), engine.adapter(b).parameters(), strict=True
        ):
            assert torch.equal(x.grad, y.grad)


def test_reduce_runs_before_the_clip_norm(engine):
    lora = LoraSpec(rank=4, seed=3)
    with (
        training_run(engine, "seam-a", lora, randomize_seed=1) as a,
        training_run(engine, "seam-b", lora, randomize_seed=1) as b,
    ):
        engine.forward_backward(a, batch(0))
        engine.forward_backward(b, batch(0))

        def double(params: list[torch.nn.Parameter]) -> None:
            for p in params:
                assert p.grad is not None
                p.grad.mul_(2)

        doubled = engine.optim_step(a, CLIP, reduce=double).metrics["grad_norm:mean"]
        plain = engine.optim_step(b, CLIP).metrics["grad_norm:mean"]
        assert doubled == pytest.approx(2 * plain, rel=1e-6)
        assert plain > 10 * CLIP.grad_clip_norm  # both were clipped to the same length,
        for x, y in zip(weights(engine, a), weights(engine, b), strict=True):
            torch.testing.assert_close(x, y)  # so Adam moves both runs alike


def test_reduce_may_give_gradients_and_a_non_finite_one_is_refused(engine):
    with training_run(engine, "seam-a", LoraSpec(rank=4, seed=3)) as a:
        before = weights(engine, a)

        def ones(params: list[torch.nn.Parameter]) -> None:
            for p in params:
                p.grad = torch.ones_like(p)

        numel = sum(p.numel() for p in engine.adapter(a).parameters())
        norm = engine.optim_step(a, CLIP, reduce=ones).metrics["grad_norm:mean"]
        assert norm == pytest.approx(numel**0.5, rel=1e-6)
        assert not all(torch.equal(x, y) for x, y in zip(before, weights(engine, a), strict=True))

        def nan(params: list[torch.nn.Parameter]) -> None:
            for p in params:
                p.grad = torch.full_like(p, float("nan"))

        with pytest.raises(UserInputError, match="not finite"):
            engine.optim_step(a, CLIP, reduce=nan)
        assert engine.steps(a) == 1
        assert not engine.gradients_pending(a)


def test_state_loaded_from_tensors_equals_one_loaded_from_its_folder(engine, tmp_path):
    with training_run(engine, "seam-a", LoraSpec(rank=4, seed=3), randomize_seed=2) as a:
        engine.forward_backward(a, batch(0))
        engine.optim_step(a, CLIP)
        engine.save_state(a, tmp_path / "s")
    state = checkpoint.read_state(tmp_path / "s", include_optimizer=True)
    engine.load_state_tensors("seam-t", state)
    engine.load_state("seam-f", tmp_path / "s")
    try:
        for run in ("seam-t", "seam-f"):
            engine.forward_backward(run, batch(1))
            engine.optim_step(run, CLIP)
        assert engine.steps("seam-t") == engine.steps("seam-f") == 2
        for x, y in zip(weights(engine, "seam-t"), weights(engine, "seam-f"), strict=True):
            assert torch.equal(x, y)
    finally:
        engine.remove_run("seam-t")
        engine.remove_run("seam-f")


def _finish(engine, keys: list[str]) -> dict[str, SampleResult]:
    done: dict[str, SampleResult] = {}
    while len(done) < len(keys):
        for key, outcome in engine.sample_step():
            assert isinstance(outcome, SampleResult)
            done[key] = outcome
    return done


def test_a_checked_request_sampled_in_shares_by_index_equals_it_whole(engine):
    request = SampleRequest(
        [3, 14, 15, 92, 65],
        SamplingParams(max_tokens=8, temperature=1.0, stop=[]),  # no seed: one is drawn
        num_samples=4,
        base_model=TINY,
        prompt_logprobs=True,
    )
    checked = engine.check_sample(request)
    assert checked.params.seed is not None
    assert engine.check_sample(request).params.seed != checked.params.seed
    engine.sample_start("whole", checked)
    engine.sample_start("even", checked, indices=[0, 2])
    engine.sample_start("odd", checked, indices=[1, 3])
    done = _finish(engine, ["whole", "even", "odd"])
    whole, even, odd = done["whole"], done["even"], done["odd"]
    tokens = [s.tokens for s in whole.sequences]
    assert [s.tokens for s in even.sequences] == tokens[0::2]
    assert [s.tokens for s in odd.sequences] == tokens[1::2]
    assert whole.prompt_logprobs is not None and even.prompt_logprobs is not None
    np.testing.assert_array_equal(even.prompt_logprobs, whole.prompt_logprobs)
    assert odd.prompt_logprobs is None  # only the share holding sample 0 scores the prompt
    with pytest.raises(ValueError, match="sample indices"):
        engine.sample_start("bad", checked, indices=[4])
