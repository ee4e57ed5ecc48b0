"""Forward/backward execution of validated training ops, several runs per pass.

The datums of all ops are laid out in order and cut into passes of at most
`max_tokens_per_pass` tokens (a datum is never split). Each pass holds rows of one or more
ops, runs one multi-LoRA forward, evaluates every op's loss on its rows, and backpropagates
at once. Because every Tinker loss is a sum over datums, summing per-pass losses and
gradients is exact; smaller passes keep activations in cache on CPU and bound peak memory on
GPU. Loss metrics are therefore all `:sum` reductions, added across passes.

This module knows nothing of validation, optimizers or run bookkeeping: it receives adapters
and checked datums and returns per-op results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpu_worker.batching import Segment, forward_logprobs
from gpu_worker.lora import LoraAdapter, LoraContext
from gpu_worker.losses import LOSSES
from gpu_worker.protocol import ForwardBackwardResult, Usage
from gpu_worker.validation import CheckedDatum


@dataclass
class TrainOp:
    adapter: LoraAdapter
    datums: list[CheckedDatum]
    loss_fn: str
    config: dict[str, float]


def plan_passes(ops: list[TrainOp], max_tokens: int) -> list[list[tuple[int, int]]]:
    """Cut the (op, datum) rows, in order, into passes of at most max_tokens tokens."""
    passes: list[list[tuple[int, int]]] = [[]]
    used = 0
    for i, op in enumerate(ops):
        for j, d in enumerate(op.datums):
            n = d.tokens.size
            if passes[-1] and used + n > max_tokens:
                passes.append([])
                used = 0
            passes[-1].append((i, j))
            used += n
    return passes


def run_ops(model: Any, ctx: LoraContext, ops: list[TrainOp], *, backward: bool,
            device: torch.device, autocast_dtype: torch.dtype | None,
            max_tokens_per_pass: int) -> list[ForwardBackwardResult]:
    logprobs: list[list[np.ndarray | None]] = [[None] * len(op.datums) for op in ops]
    elementwise: list[list[np.ndarray | None]] = [[None] * len(op.datums) for op in ops]
    metrics: list[dict[str, float]] = [{} for _ in ops]
    params = {id(p): p for op in ops for p in op.adapter.parameters()}
    snapshot = {k: None if p.grad is None else p.grad.clone() for k, p in params.items()} \
        if backward else {}
    try:
        for rows in plan_passes(ops, max_tokens_per_pass):
            # consecutive rows of the same op form one segment (one LoRA row group)
            seg_rows: list[list[tuple[int, int]]] = []
            for row in rows:
                if seg_rows and seg_rows[-1][0][0] == row[0]:
                    seg_rows[-1].append(row)
                else:
                    seg_rows.append([row])
            segments = [Segment(ops[r[0][0]].adapter, [ops[i].datums[j] for i, j in r])
                        for r in seg_rows]
            with torch.set_grad_enabled(backward):
                outs = forward_logprobs(model, ctx, segments, device, autocast_dtype)
                total: torch.Tensor | None = None
                for r, out in zip(seg_rows, outs, strict=True):
                    op = ops[r[0][0]]
                    loss = LOSSES[op.loss_fn](out.logp, out.inputs, out.datum_N,
                                              len(out.lengths), op.config)
                    total = loss.loss if total is None else total + loss.loss
                    for key, value in loss.metrics.items():
                        metrics[r[0][0]][key] = metrics[r[0][0]].get(key, 0.0) + value
                    lp = out.logp.detach().float().cpu().numpy()
                    el = loss.elementwise_N.float().cpu().numpy()
                    start = 0
                    for (i, j), n in zip(r, out.lengths, strict=True):
                        logprobs[i][j] = lp[start:start + n].copy()
                        elementwise[i][j] = el[start:start + n].copy()
                        start += n
                if backward and total is not None and total.requires_grad:
                    total.backward()
    except Exception:
        for k, p in params.items():  # a failed op must not leave half its gradient behind
            if backward:
                p.grad = snapshot[k]
        raise
    results = []
    for i, op in enumerate(ops):
        outputs = [{"logprobs": lp, "elementwise_loss": el}
                   for lp, el in zip(logprobs[i], elementwise[i], strict=True)]
        tokens = sum(d.tokens.size for d in op.datums)
        results.append(ForwardBackwardResult(outputs, metrics[i],  # type: ignore[arg-type]
                                             Usage(trained_tokens=tokens)))
    return results
