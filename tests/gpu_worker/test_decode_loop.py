"""The engine's running decode loops: jobs started under keys and stepped one decode step at a
time, joining mid-flight, keeping the weights they started with while the run trains, coming
out of `sample_batch` without losing other jobs, aborted, and failing one model's loop alone."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from gpu_worker import sampling
from gpu_worker.engine import Engine
from gpu_worker.protocol import (
    AdamParams,
    Datum,
    LoraSpec,
    OpError,
    SampleRequest,
    SampleResult,
    SamplingParams,
)
from gpu_worker.sampling import Sampler
from tests.gpu_worker.helpers import TINY, sample, training_run

pytestmark = pytest.mark.unit

PROMPT = [5, 17, 300, 42, 8]
OTHER_MODEL = "treadle/tiny-qwen-1m"


@pytest.fixture
def loops(engine: Engine) -> Iterator[Engine]:
    """The shared engine, with no job left in its loops after the test."""
    assert engine.sampling == 0
    yield engine
    engine.sample_abort()
    engine.sample_step()  # returns nothing once aborted; leaves no loop half-stepped


@pytest.fixture
def run(engine: Engine) -> Iterator[str]:
    with training_run(engine, "decode", LoraSpec(rank=4, seed=5), randomize_seed=6) as run_id:
        yield run_id


def request(seed: int, run_id: str | None = None, *, max_tokens: int = 10, **kw) -> SampleRequest:
    params = SamplingParams(max_tokens=max_tokens, seed=seed, stop=[], **kw)
    return SampleRequest(PROMPT, params, 2, run_id=run_id, base_model=TINY)


def finish(engine: Engine, keys: set[str]) -> dict[str, SampleResult | OpError]:
    """Step until the jobs under `keys` are out; every result that came out, by key."""
    out: dict[str, SampleResult | OpError] = {}
    while not keys <= out.keys():
        out.update(engine.sample_step())
    return out


def succeeded(outcome: SampleResult | OpError) -> SampleResult:
    assert isinstance(outcome, SampleResult), outcome
    return outcome


def assert_same_samples(got: SampleResult, want: SampleResult) -> None:
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
    for s, t in zip(got.sequences, want.sequences, strict=True):
        np.testing.assert_allclose(s.logprobs, t.logprobs, atol=1e-4)


def train_step(engine: Engine, run_id: str) -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, 12)
    datum = Datum(tokens, {"target_tokens": np.roll(tokens, -1), "weights": np.ones(12)})
    engine.forward_backward(run_id, [datum])
    engine.optim_step(run_id, AdamParams(learning_rate=0.05))


def test_a_job_joining_mid_flight_samples_as_if_alone(loops, run):
    first, late = request(1, run, max_tokens=12), request(2, max_tokens=8, temperature=0.8)
    assert loops.sample_start("first", first) is None
    for k in range(1, 4):
        assert loops.sample_step() == []
        assert [len(t) for t in loops.sample_progress("first")] == [k, k]
    assert loops.sample_start("late", late) is None
    assert loops.sample_progress("late") == [[], []]
    assert loops.sampling == 2
    out = finish(loops, {"first", "late"})
    assert_same_samples(succeeded(out["first"]), sample(loops, first))
    assert_same_samples(succeeded(out["late"]), sample(loops, late))
    assert succeeded(out["late"]).usage.sampled_tokens == 16
    assert loops.sampling == 0


def test_a_running_job_keeps_the_weights_it_started_with(loops, run):
    req = request(7, run, temperature=1.0)
    req.prompt_logprobs = True
    before = sample(loops, req)
    loops.sample_start("live", req)
    for _ in range(3):
        loops.sample_step()
    assert loops.frozen_memory_bytes() == 0  # sampling the run's own weights: nothing extra
    train_step(loops, run)
    assert loops.frozen_memory_bytes() == loops.adapter(run).num_bytes()
    loops.sample_start("after", req)
    out = finish(loops, {"live", "after"})
    assert_same_samples(succeeded(out["live"]), before)
    assert loops.frozen_memory_bytes() == 0  # the copy went with the sample that kept it
    after = succeeded(out["after"])
    assert_same_samples(after, sample(loops, req))  # the new weights, as a fresh sample sees them
    assert after.prompt_logprobs is not None and before.prompt_logprobs is not None
    assert not np.allclose(after.prompt_logprobs[1:], before.prompt_logprobs[1:], atol=1e-3)


def test_a_running_job_outlives_its_run(loops, engine):
    with training_run(engine, "gone", LoraSpec(rank=4, seed=8), randomize_seed=9) as run_id:
        req = request(3, run_id)
        before = sample(loops, req)
        loops.sample_start("orphan", req)
        loops.sample_step()
    out = finish(loops, {"orphan"})
    assert_same_samples(succeeded(out["orphan"]), before)


def test_sample_batch_keeps_other_jobs_results_for_the_next_step(loops, run):
    other, mine = request(4, run, max_tokens=3), request(5, max_tokens=9)
    loops.sample_start("other", other)
    loops.sample_step()
    (result,) = loops.sample_batch([mine])
    assert_same_samples(succeeded(result), sample(loops, mine))
    assert loops.sampling == 1  # finished meanwhile, not yet handed out
    assert [len(t) for t in loops.sample_progress("other")] == [3, 3]
    ((key, outcome),) = loops.sample_step()
    assert key == "other"
    assert_same_samples(succeeded(outcome), sample(loops, other))
    assert loops.sampling == 0 and loops.sample_step() == []


def test_refused_requests_and_reused_keys(loops):
    refused = loops.sample_start("bad", SampleRequest([5, 99999], base_model=TINY))
    assert isinstance(refused, OpError) and refused.category == "user"
    assert loops.sampling == 0
    loops.sample_start("k", request(1))
    with pytest.raises(ValueError, match="already in use"):
        loops.sample_start("k", request(2))


def test_abort_drops_jobs_and_the_rest_sample_as_if_alone(loops, run):
    kept = request(1, run)
    loops.sample_start("kept", kept)
    loops.sample_start("dropped", request(2, max_tokens=30))
    loops.sample_step()
    loops.sample_abort(["dropped", "never-started"])
    assert loops.sampling == 1 and loops.sample_progress("dropped") == []
    out = finish(loops, {"kept"})
    assert set(out) == {"kept"}
    assert_same_samples(succeeded(out["kept"]), sample(loops, kept))

    loops.sample_start("a", request(3))
    loops.sample_start("b", request(4, run))
    loops.sample_step()
    loops.sample_abort()
    assert loops.sampling == 0
    assert loops.sample_step() == []


def test_sequences_come_in_sample_order_whatever_order_they_finish_in(loops):
    free = sample(loops, SampleRequest(PROMPT, SamplingParams(12, seed=11, stop=[]), 4, None, TINY))
    runs = [s.tokens for s in free.sequences]

    def stops_at(tokens: list[int], stop: int) -> int:
        return tokens.index(stop) if stop in tokens else len(tokens)

    # a stop token that ends the last sample before the first
    stop = next(t for t in runs[3] if stops_at(runs[3], t) < stops_at(runs[0], t))
    params = SamplingParams(12, seed=11, stop=[stop])
    loops.sample_start("s", SampleRequest(PROMPT, params, 4, None, TINY))
    res = succeeded(finish(loops, {"s"})["s"])
    assert [s.tokens for s in res.sequences] == [t[: stops_at(t, stop) + 1] for t in runs]
    assert res.sequences[3].stop_reason == "stop"
    alone = sample(
        loops, SampleRequest(PROMPT, SamplingParams(12, seed=11, stop=[]), 1, None, TINY)
    )
    assert alone.sequences[0].tokens == runs[0]


def test_a_failing_loop_fails_its_own_jobs_and_starts_over(loops, monkeypatch):
    tiny = loops.base_module(TINY)
    healthy = request(2, max_tokens=4)
    healthy.base_model = OTHER_MODEL
    want = sample(loops, request(1, max_tokens=4))
    real_feed = Sampler._feed

    def feed(self: Sampler, token_A):  # breaks only the tiny model's loop
        if self.model is tiny:
            raise RuntimeError("device lost")
        return real_feed(self, token_A)

    monkeypatch.setattr(Sampler, "_feed", feed)
    loops.sample_start("broken", request(1, max_tokens=4))
    loops.sample_start("healthy", healthy)
    out = dict(loops.sample_step())
    assert out["broken"] == OpError("server", "RuntimeError: device lost", interrupted=True)
    assert loops.sampling == 1
    monkeypatch.setattr(Sampler, "_feed", real_feed)
    out = finish(loops, {"healthy"})
    assert_same_samples(succeeded(out["healthy"]), sample(loops, healthy))
    loops.sample_start("again", request(1, max_tokens=4))  # a fresh loop on the tiny model
    assert_same_samples(succeeded(finish(loops, {"again"})["again"]), want)


def test_a_model_without_full_attention_admits_jobs_when_its_loop_is_idle(loops, monkeypatch):
    monkeypatch.setattr(sampling, "_full_attention", lambda cache: False)
    first, late = request(1, max_tokens=4), request(2, max_tokens=5)
    loops.sample_start("first", first)
    loops.sample_step()
    loops.sample_start("late", late)
    out: dict[str, SampleResult | OpError] = {}
    while "first" not in out:
        assert loops.sample_progress("late") == [[], []]  # waits, never refused
        out.update(loops.sample_step())
    out.update(finish(loops, {"late"}))
    assert_same_samples(succeeded(out["first"]), sample(loops, first))
    assert_same_samples(succeeded(out["late"]), sample(loops, late))


def test_reloading_a_run_leaves_a_running_job_on_the_old_weights(loops, engine, run, tmp_path):
    with training_run(engine, "donor", LoraSpec(rank=4, seed=5), randomize_seed=12) as donor:
        engine.save_state(donor, tmp_path / "donor", include_optimizer=False)
    req = request(8, run)
    req.prompt_logprobs = True
    before = sample(loops, req)
    loops.sample_start("live", req)
    loops.sample_step()
    loops.load_state(run, tmp_path / "donor", include_optimizer=False)
    loops.sample_start("after", req)
    out = finish(loops, {"live", "after"})
    assert_same_samples(succeeded(out["live"]), before)
    after = succeeded(out["after"]).prompt_logprobs
    assert after is not None and before.prompt_logprobs is not None
    assert not np.allclose(after[1:], before.prompt_logprobs[1:], atol=1e-3)


def test_a_frozen_copy_keeps_the_weights_without_gradients(engine, run):
    adapter = engine.adapter(run)
    frozen = adapter.frozen_copy()
    saved = {k: t.clone() for k, t in adapter.named_tensors().items()}
    train_step(engine, run)
    assert all(not p.requires_grad and p.grad is None for p in frozen.parameters())
    assert frozen.scale == adapter.scale and frozen.spec == adapter.spec
    for key, tensor in frozen.named_tensors().items():
        assert torch.equal(tensor, saved[key])
    assert any(not torch.equal(t, saved[k]) for k, t in adapter.named_tensors().items())
