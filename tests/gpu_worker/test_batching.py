"""Cross-run batching: runs of ranks 1, 8, 32, 64 in one pass get what they get alone."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from gpu_worker.protocol import Datum, ForwardBackwardOp, LoraSpec, OpError
from tests.gpu_worker.helpers import TINY, adapter_grads, rng_tokens, training_run

pytestmark = pytest.mark.unit

RANKS = (1, 8, 32, 64)


def ce_data(seed: int, lengths: tuple[int, ...]) -> list[Datum]:
    rng = np.random.default_rng(seed)
    return [
        Datum(
            rng_tokens(rng, n),
            {"target_tokens": rng_tokens(rng, n), "weights": rng.random(n).astype(np.float32)},
        )
        for n in lengths
    ]


def rl_data(seed: int, lengths: tuple[int, ...]) -> list[Datum]:
    rng = np.random.default_rng(seed)
    return [
        Datum(
            rng_tokens(rng, n),
            {
                "target_tokens": rng_tokens(rng, n),
                "logprobs": (-7 + rng.normal(scale=0.3, size=n)).astype(np.float32),
                "advantages": rng.normal(size=n).astype(np.float32),
            },
        )
        for n in lengths
    ]


@contextlib.contextmanager
def make_runs(engine, prefix: str) -> Iterator[list[str]]:
    """One run of each rank for the duration of the block."""
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                training_run(
                    engine,
                    f"{prefix}-{rank}",
                    LoraSpec(rank=rank, seed=i, train_unembed=i % 2 == 0, train_mlp=i != 3),
                    randomize_seed=100 + i,
                )
            )
            for i, rank in enumerate(RANKS)
        ]


def make_ops(ids: list[str]) -> list[ForwardBackwardOp]:
    ops = []
    for i, rid in enumerate(ids):
        if i % 2:
            ops.append(ForwardBackwardOp(rid, rl_data(i, (5 + i, 17)), "ppo"))
        else:
            ops.append(ForwardBackwardOp(rid, ce_data(i, (9, 3 + 4 * i)), "cross_entropy"))
    return ops


def test_mixed_ranks_batched_equal_alone(engine):
    with make_runs(engine, "alone") as alone_ids, make_runs(engine, "batch") as batch_ids:
        alone = [
            engine.forward_backward(op.run_id, op.data, op.loss_fn) for op in make_ops(alone_ids)
        ]
        batched = engine.forward_backward_batch(make_ops(batch_ids))
        for a_id, b_id, a, b in zip(alone_ids, batch_ids, alone, batched, strict=True):
            assert not isinstance(b, OpError), b
            assert b.metrics["loss:sum"] == pytest.approx(a.metrics["loss:sum"], rel=1e-5)
            for out_a, out_b in zip(a.loss_fn_outputs, b.loss_fn_outputs, strict=True):
                np.testing.assert_allclose(out_b["logprobs"], out_a["logprobs"], atol=1e-5)
            ga, gb = adapter_grads(engine, a_id), adapter_grads(engine, b_id)
            assert ga.keys() == gb.keys()
            scale = max(float(g.abs().max()) for g in ga.values())
            for key in ga:
                torch.testing.assert_close(gb[key], ga[key], atol=1e-5 * max(scale, 1.0), rtol=1e-3)


def test_bad_datum_in_one_run_does_not_fail_the_others(engine):
    with make_runs(engine, "bad") as ids:
        ops = make_ops(ids)
        bad = ops[1].data[0]
        bad.loss_fn_inputs["advantages"] = bad.loss_fn_inputs["advantages"][:-1]
        results = engine.forward_backward_batch([*ops, ForwardBackwardOp("nope", ops[0].data)])
        assert isinstance(results[1], OpError) and results[1].category == "user"
        assert "advantages" in results[1].message
        assert isinstance(results[4], OpError) and "unknown run" in results[4].message
        for i in (0, 2, 3):
            assert not isinstance(results[i], OpError)
        assert all(p.grad is None for p in engine.adapter(ids[1]).parameters())


def test_memory_is_base_plus_adapters(engine):
    base = engine.base_module(TINY)
    base_ptrs = {p.data_ptr() for p in base.parameters()}
    with training_run(engine, "mem", LoraSpec(rank=8)):
        adapter = engine.adapter("mem")
        assert not base_ptrs & {p.data_ptr() for p in adapter.parameters()}
        assert {p.data_ptr() for p in base.parameters()} == base_ptrs  # no base copy
        assert engine.run_memory_bytes("mem") == adapter.num_bytes()


def test_a_failing_batched_pass_is_retried_op_by_op(engine, monkeypatch):
    import gpu_worker.engine as engine_module

    real = engine_module.run_ops

    def flaky(model, ctx, ops, **kw):
        if len(ops) > 1:
            raise RuntimeError("simulated device failure")
        if ops[0].adapter is engine.adapter(ids[2]):
            raise RuntimeError("this run's pass fails alone too")
        return real(model, ctx, ops, **kw)

    monkeypatch.setattr(engine_module, "run_ops", flaky)
    with make_runs(engine, "retry") as ids:
        results = engine.forward_backward_batch(make_ops(ids))
        assert isinstance(results[2], OpError) and results[2].category == "server"
        assert all(not isinstance(results[i], OpError) for i in (0, 1, 3))
        assert all(p.grad is None for p in engine.adapter(ids[2]).parameters())
