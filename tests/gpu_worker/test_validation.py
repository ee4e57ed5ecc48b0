"""Bad input is rejected with a message that says what to change, and leaves the run untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.protocol import (
    AdamParams,
    Datum,
    LoraSpec,
    SampleRequest,
    SamplingParams,
    UserInputError,
)
from tests.gpu_worker.helpers import TINY, VOCAB, rng_tokens, sample, training_run

pytestmark = pytest.mark.unit


def good(n: int = 6) -> Datum:
    rng = np.random.default_rng(n)
    return Datum(
        rng_tokens(rng, n), {"target_tokens": rng_tokens(rng, n), "weights": np.ones(n, np.float32)}
    )


def rl(n: int = 6, **override) -> Datum:
    rng = np.random.default_rng(n)
    inputs = {
        "target_tokens": rng_tokens(rng, n),
        "logprobs": np.full(n, -7.0, np.float32),
        "advantages": np.ones(n, np.float32),
    }
    inputs.update(override)
    return Datum(rng_tokens(rng, n), inputs)


CASES = [
    (
        "cross_entropy",
        None,
        [Datum([1, 2, VOCAB], {"target_tokens": [1, 2, 3], "weights": np.ones(3)})],
        "outside",
    ),
    (
        "cross_entropy",
        None,
        [Datum([1, 2, 3], {"target_tokens": [1, 2, -1], "weights": np.ones(3)})],
        "outside",
    ),
    (
        "cross_entropy",
        None,
        [Datum([1, 2, 3], {"target_tokens": [1, 2], "weights": np.ones(3)})],
        "target_tokens",
    ),
    (
        "cross_entropy",
        None,
        [Datum([1, 2, 3], {"target_tokens": [1, 2, 3], "weights": np.ones(2)})],
        "weights",
    ),
    ("importance_sampling", None, [rl(advantages=np.ones(4, np.float32))], "advantages"),
    ("ppo", None, [rl(logprobs=np.ones(9, np.float32))], "logprobs"),
    ("ppo", None, [rl(advantages=np.array([1, np.nan, 1, 1, 1, 1], np.float32))], "finite"),
    (
        "cross_entropy",
        None,
        [Datum([1, 2, 3], {"target_tokens": [1, 2, 3], "weights": [1.0, np.inf, 1.0]})],
        "finite",
    ),
    ("kl_magic", None, [good()], "unknown loss_fn"),
    ("cross_entropy", None, [Datum([1, 2], {"target_tokens": [1, 2]})], "missing"),
    (
        "cross_entropy",
        None,
        [Datum([1, 2], {"target_tokens": [1, 2], "weights": [1, 1], "mask": [1, 1]})],
        "not used",
    ),
    ("gspo", None, [rl(sequence_ratio_mask=np.ones(5, np.float32))], "sequence_ratio_mask"),
    ("ppo", None, [rl(clip_high_threshold=np.full(4, 1.1, np.float32))], "clip_high_threshold"),
    ("cispo", None, [rl(clip_low_threshold=np.array([1.3], np.float32))], "ratios"),
    ("importance_sampling", None, [rl(clip_low_threshold=np.array([0.9]))], "not used"),
    (
        "cross_entropy",
        None,
        [
            Datum(
                np.zeros(2049, np.int64),
                {"target_tokens": np.zeros(2049, np.int64), "weights": np.ones(2049)},
            )
        ],
        "context length",
    ),
    ("cross_entropy", None, [], "at least one datum"),
    ("ppo", {"clip_low": 0.5}, [rl()], "clip_low_threshold"),
    ("dro", None, [rl()], "beta"),
    ("stable_reinforce", None, [rl()], "ppo"),
]


def snapshot(engine, run):
    adapter = engine.adapter(run)
    params = [p.detach().clone() for p in adapter.parameters()]
    grads = [None if p.grad is None else p.grad.clone() for p in adapter.parameters()]
    return params, grads, engine.steps(run)


def assert_same(a, b):
    for x, y in zip(a[0], b[0], strict=True):
        assert torch.equal(x, y)
    for x, y in zip(a[1], b[1], strict=True):
        assert (x is None and y is None) or torch.equal(x, y)
    assert a[2] == b[2]


@pytest.fixture(scope="module")
def run(engine):
    with training_run(engine, "validate", LoraSpec(rank=4, seed=1)) as run_id:
        yield run_id


@pytest.mark.parametrize(("loss_fn", "config", "data", "needle"), CASES)
def test_bad_forward_backward_is_rejected_without_side_effects(
    engine, run, loss_fn, config, data, needle
):
    engine.forward_backward(run, [good()])  # some accumulated gradient to protect
    before = snapshot(engine, run)
    with pytest.raises(UserInputError, match=needle):
        engine.forward_backward(run, data, loss_fn, config)
    assert_same(before, snapshot(engine, run))


def test_rank_above_maximum(engine):
    with pytest.raises(UserInputError, match="pass rank ≤ 64"):
        engine.create_run("too-big", TINY, LoraSpec(rank=65))
    with pytest.raises(UserInputError, match="unknown base model"):
        engine.create_run("nope", "no/such-model", LoraSpec(rank=1))
    assert "too-big" not in engine.run_ids() and "nope" not in engine.run_ids()


def test_bad_adam_and_sampling_params(engine, run):
    before = snapshot(engine, run)
    with pytest.raises(UserInputError, match="learning_rate"):
        engine.optim_step(run, AdamParams(learning_rate=float("nan")))
    assert_same(before, snapshot(engine, run))
    bad = [
        SamplingParams(max_tokens=0),
        SamplingParams(top_p=0.0),
        SamplingParams(top_k=0),
        SamplingParams(temperature=-1.0),
        SamplingParams(max_tokens=5000),
    ]
    for params in bad:
        with pytest.raises(UserInputError):
            sample(engine, SampleRequest(prompt=[1, 2], params=params, run_id=run))
    with pytest.raises(UserInputError, match="vocabulary"):
        sample(engine, SampleRequest(prompt=[1, VOCAB + 5], run_id=run))
