"""Splitting a forward_backward batch over ranks by token count and merging the results: the
cuts, the round trip, ops with fewer datums than ranks, and two engines on the slices with
summed gradients against one engine on the whole batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.engine import Engine, EngineSettings
from gpu_worker.protocol import (
    AdamParams,
    Datum,
    ForwardBackwardOp,
    ForwardBackwardResult,
    LoraSpec,
    OpError,
    SampledSequence,
    SampleResult,
    Usage,
)
from gpu_worker.sharding import (
    merge_result,
    merge_samples,
    shard_ops,
    split_by_tokens,
    split_samples,
)
from gpu_worker.validation import CheckedDatum, CheckedOp
from tests.gpu_worker.group_helpers import datums as group_datums
from tests.gpu_worker.helpers import TINY, assert_same_loss, randomize_adapter

pytestmark = pytest.mark.unit

ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)


@pytest.mark.parametrize(
    ("sizes", "world"),
    [
        ([5, 9, 3, 30, 2, 2, 8], 2),
        ([5, 9, 3, 30, 2, 2, 8], 3),
        ([1] * 10, 4),
        ([7], 3),
        ([4, 4], 3),
        ([], 2),
        ([3, 1, 2], 1),
    ],
)
def test_cuts_are_contiguous_in_order_and_balanced(sizes, world):
    ranges = split_by_tokens(sizes, world)
    assert len(ranges) == world
    assert [i for r in ranges for i in r] == list(range(len(sizes)))  # all, once, in order
    share = sum(sizes) / world
    for r in ranges:
        # each cut lands within half a datum of its share, so no rank is more than one datum over
        assert sum(sizes[i] for i in r) <= share + max(sizes, default=0)


def test_balance_on_uneven_datums():
    assert split_by_tokens([10, 10, 10, 10], 2) == [range(0, 2), range(2, 4)]
    assert split_by_tokens([30, 2, 2, 2, 2, 2], 2) == [range(0, 1), range(1, 6)]
    assert split_by_tokens([10], 2) == [range(0, 1), range(1, 1)]


def checked(sizes: list[int], run_id: str = "r") -> CheckedOp:
    datums = [
        CheckedDatum(
            np.full(n, j, np.int64),
            {"target_tokens": np.zeros(n, np.int64), "weights": np.ones(n, np.float32)},
        )
        for j, n in enumerate(sizes)
    ]
    return CheckedOp(run_id, "cross_entropy", {}, datums)


def fake_result(op: CheckedOp) -> ForwardBackwardResult:
    """What a rank would return: each datum's output names the datum (its token value)."""
    outputs = [{"logprobs": d.tokens.astype(np.float32)} for d in op.datums]
    n = sum(d.tokens.size for d in op.datums)
    metrics = {"loss:sum": float(n), "clipped_tokens:sum": 1.0, "peak:max": float(len(outputs))}
    return ForwardBackwardResult(outputs, metrics, Usage(trained_tokens=n))


def test_split_then_merge_gives_back_every_datum_in_order():
    refused = OpError("user", "bad datum")
    ops: list[CheckedOp | OpError] = [checked([3, 8, 1, 12, 5]), refused, checked([2])]
    shards = shard_ops(ops, 3)
    assert [shard[1] for shard in shards] == [None, None, None]
    # the one-datum op lands on one rank; the others skip it
    assert sum(shard[2] is not None for shard in shards) == 1
    for i, op in enumerate(ops):
        if isinstance(op, OpError):
            continue
        parts = [None if (part := s[i]) is None else fake_result(part) for s in shards]
        merged = merge_result(parts)
        assert isinstance(merged, ForwardBackwardResult)
        got = [int(out["logprobs"][0]) for out in merged.loss_fn_outputs]
        assert got == list(range(len(op.datums)))
        tokens = sum(d.tokens.size for d in op.datums)
        assert merged.metrics["loss:sum"] == tokens
        assert merged.metrics["clipped_tokens:sum"] == sum(p is not None for p in parts)
        assert merged.metrics["peak:max"] == max(len(p.loss_fn_outputs) for p in parts if p)
        assert merged.usage.trained_tokens == tokens


def test_a_failure_on_any_rank_fails_the_op_and_unknown_reductions_refuse():
    ok = fake_result(checked([4]))
    failed = OpError("server", "RuntimeError: rank 1")
    assert merge_result([ok, failed, None]) is failed
    with pytest.raises(ValueError, match="grad_norm:mean"):
        merge_result([ForwardBackwardResult([], {"grad_norm:mean": 1.0}, Usage())] * 2)


@pytest.mark.parametrize(
    ("num_samples", "loads", "shares"),
    [
        (4, [0, 0], [[0, 2], [1, 3]]),
        (1, [3, 1], [[], [0]]),
        (3, [2, 0, 1], [[], [0, 1], [2]]),
        (2, [5, 0], [[], [0, 1]]),
    ],
)
def test_samples_go_to_the_least_loaded_ranks(num_samples, loads, shares):
    assert split_samples(num_samples, loads) == shares


def test_sample_shares_merge_back_by_index():
    def share(indices: list[int], lp: np.ndarray | None) -> tuple[list[int], SampleResult]:
        seqs = [SampledSequence([i, i], [-1.0, -2.0], "length") for i in indices]
        usage = Usage(prefill_tokens=5, sampled_tokens=2 * len(indices))
        return indices, SampleResult(seqs, lp, None, usage)

    scores = np.array([np.nan, -1.5], np.float32)
    merged = merge_samples([share([1, 3], None), share([0, 2], scores)])
    assert [s.tokens[0] for s in merged.sequences] == [0, 1, 2, 3]
    assert merged.prompt_logprobs is scores
    assert merged.usage == Usage(prefill_tokens=5, sampled_tokens=8)  # one prefill
    with pytest.raises(ValueError, match="not 0 to n - 1"):
        merge_samples([share([1, 3], None)])


# --- two engines on slices equal one engine ---------------------------------------------

RUNS = {  # run id: loss, LoRA rank
    "shard-ce": ("cross_entropy", 8),
    "shard-ppo": ("ppo", 4),
    "shard-is": ("importance_sampling", 2),
}


def datums(seed: int, loss: str) -> list[Datum]:
    return group_datums(seed, loss, n=5)


def step_ops(step: int) -> list[ForwardBackwardOp]:
    return [
        ForwardBackwardOp(run, datums(100 * step + i, loss), loss)
        for i, (run, (loss, _)) in enumerate(RUNS.items())
    ]


@pytest.fixture(scope="module")
def second_engine() -> Engine:
    return Engine(EngineSettings(device="cpu", precision="fp32", num_threads=1))


def summed_grads(engines: list[Engine], run: str) -> list[torch.Tensor]:
    """The run's gradient summed over engines (an engine that had no slice has none)."""
    per_engine = [e.adapter(run).parameters() for e in engines]
    return [
        sum((p.grad for p in params if p.grad is not None), torch.zeros_like(params[0]))
        for params in zip(*per_engine, strict=True)
    ]


def test_two_engines_on_slices_with_summed_gradients_equal_one_engine(engine, second_engine):
    whole = {run: f"{run}-whole" for run in RUNS}
    ranks = [engine, second_engine]
    for seed, (run, (_, rank)) in enumerate(RUNS.items()):
        for e, name in ((engine, run), (engine, whole[run]), (second_engine, run)):
            e.create_run(name, TINY, LoraSpec(rank=rank))
            randomize_adapter(e, name, seed=seed)
    try:
        for step in range(3):
            expected = engine.forward_backward_batch(
                [ForwardBackwardOp(whole[o.run_id], o.data, o.loss_fn) for o in step_ops(step)]
            )
            shards = shard_ops(engine.prepare_batch(step_ops(step)), len(ranks))
            parts = [e.execute_checked(shard) for e, shard in zip(ranks, shards, strict=True)]
            for i, want in enumerate(expected):
                got = merge_result([p[i] for p in parts])
                assert isinstance(got, ForwardBackwardResult)
                assert isinstance(want, ForwardBackwardResult)
                assert_same_loss(got, want)
            for run in RUNS:
                total = summed_grads(ranks, run)

                def use_total(params, total=total):
                    for p, g in zip(params, total, strict=True):
                        p.grad = g.clone()

                for e in ranks:
                    e.optim_step(run, ADAM, reduce=use_total)
                engine.optim_step(whole[run], ADAM)
        for run in RUNS:
            want = engine.adapter(whole[run]).named_tensors()
            got = engine.adapter(run).named_tensors()
            replica = second_engine.adapter(run).named_tensors()
            for key in want:
                torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-5)
                assert torch.equal(got[key], replica[key])
    finally:
        for name in [*RUNS, *whole.values()]:
            engine.remove_run(name)
        for name in RUNS:
            second_engine.remove_run(name)
