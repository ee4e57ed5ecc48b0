"""Forward/backward execution of validated training ops, several runs per pass.

The datums of all ops are laid out in order and cut into passes of at most
`max_tokens_per_pass` tokens (a datum is never split). Each pass holds rows of one or more
ops, runs one multi-LoRA forward, evaluates every op's loss on its rows, and backpropagates
at once. Because every Tinker loss is a sum over datums, summing per-pass losses and
gradients is exact; smaller passes keep activations in cache on CPU and bound peak memory on
GPU. Loss metrics are therefore all `:sum` reductions, added across passes.

Shapes: N is the tokens of one segment's datums flattened in order, K the top-K targets of a
datum that sends them, T the tokens of one datum.

This module knows nothing of validation, optimizers or run bookkeeping: it receives adapters
and checked datums and returns per-op results.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpu_worker.batching import Segment, SegmentLogprobs, forward_logprobs
from gpu_worker.lora import LoraAdapter, LoraContext
from gpu_worker.losses import LOSSES, LossOutput
from gpu_worker.protocol import ForwardBackwardResult, Usage
from gpu_worker.validation import CheckedDatum


@dataclass
class TrainOp:
    """One run's checked forward or forward_backward request."""

    adapter: LoraAdapter
    datums: list[CheckedDatum]
    loss_fn: str
    config: dict[str, float]


@dataclass
class PassSegment:
    """The consecutive datums of one op inside one pass: one LoRA row group, one loss call.

    An op whose datums straddle a pass boundary has one segment in each pass.
    """

    op_index: int
    datum_indices: list[int]


@dataclass
class OpOutputs:
    """What the passes gather for one op: per-datum arrays and metrics summed over passes."""

    # datum index → (T,), or (T, K) for top-K targets
    logprobs: dict[int, np.ndarray] = field(default_factory=dict)
    # datum index → (T,)
    elementwise_loss: dict[int, np.ndarray] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def add(self, segment: PassSegment, logprobs: SegmentLogprobs, loss: LossOutput) -> None:
        for key, value in loss.metrics.items():
            self.metrics[key] = self.metrics.get(key, 0.0) + value
        logp = logprobs.logp.detach().float().cpu().numpy()  # (N,) or (N, K)
        elementwise_N = loss.elementwise_N.float().cpu().numpy()
        start = 0
        for datum_index, n_tokens in zip(segment.datum_indices, logprobs.lengths, strict=True):
            end = start + n_tokens
            self.logprobs[datum_index] = logp[start:end].copy()
            self.elementwise_loss[datum_index] = elementwise_N[start:end].copy()
            start = end

    def result(self, op: TrainOp) -> ForwardBackwardResult:
        outputs = [
            {"logprobs": self.logprobs[j], "elementwise_loss": self.elementwise_loss[j]}
            for j in range(len(op.datums))
        ]
        trained_tokens = sum(d.tokens.size for d in op.datums)
        return ForwardBackwardResult(outputs, self.metrics, Usage(trained_tokens=trained_tokens))


def plan_passes(ops: list[TrainOp], max_tokens: int) -> list[list[PassSegment]]:
    """Cut the ops' datums, in order, into passes of at most max_tokens tokens."""
    passes: list[list[PassSegment]] = [[]]
    used = 0
    for op_index, op in enumerate(ops):
        for datum_index, datum in enumerate(op.datums):
            n_tokens = datum.tokens.size
            if passes[-1] and used + n_tokens > max_tokens:
                passes.append([])
                used = 0
            segments = passes[-1]
            if not segments or segments[-1].op_index != op_index:
                segments.append(PassSegment(op_index, []))
            segments[-1].datum_indices.append(datum_index)
            used += n_tokens
    return passes


def run_ops(
    model: Any,
    ctx: LoraContext,
    ops: list[TrainOp],
    *,
    backward: bool,
    device: torch.device,
    autocast_dtype: torch.dtype | None,
    max_tokens_per_pass: int,
) -> list[ForwardBackwardResult]:
    """Each op's loss over its datums, one result per op; gradients add onto the adapters'.

    When `backward` is set and any pass fails, every adapter's gradient is put back as it was
    before the call, so a failed op leaves no half gradient behind.
    """
    outputs = [OpOutputs() for _ in ops]
    grads_before = _snapshot_grads(ops) if backward else []
    try:
        for segments in plan_passes(ops, max_tokens_per_pass):
            _run_pass(
                model,
                ctx,
                ops,
                segments,
                outputs,
                backward=backward,
                device=device,
                autocast_dtype=autocast_dtype,
            )
    except Exception:
        for param, grad in grads_before:
            param.grad = grad
        raise
    return [out.result(op) for op, out in zip(ops, outputs, strict=True)]


def _run_pass(
    model: Any,
    ctx: LoraContext,
    ops: list[TrainOp],
    segments: list[PassSegment],
    outputs: list[OpOutputs],
    *,
    backward: bool,
    device: torch.device,
    autocast_dtype: torch.dtype | None,
) -> None:
    """One forward over the pass's segments, every segment's loss, one backward of their sum."""
    batch = []
    for segment in segments:
        op = ops[segment.op_index]
        batch.append(Segment(op.adapter, [op.datums[j] for j in segment.datum_indices]))
    with torch.set_grad_enabled(backward):
        segment_logprobs = forward_logprobs(model, ctx, batch, device, autocast_dtype)
        pass_loss: torch.Tensor | None = None
        for segment, logprobs in zip(segments, segment_logprobs, strict=True):
            op = ops[segment.op_index]
            loss = LOSSES[op.loss_fn](
                logprobs.logp, logprobs.inputs, logprobs.datum_N, len(logprobs.lengths), op.config
            )
            pass_loss = loss.loss if pass_loss is None else pass_loss + loss.loss
            outputs[segment.op_index].add(segment, logprobs, loss)
        if backward and pass_loss is not None and pass_loss.requires_grad:
            pass_loss.backward()


def _snapshot_grads(ops: list[TrainOp]) -> list[tuple[torch.nn.Parameter, torch.Tensor | None]]:
    """Each distinct adapter parameter with a copy of its gradient (None when it has none)."""
    params = {id(p): p for op in ops for p in op.adapter.parameters()}
    return [(p, None if p.grad is None else p.grad.clone()) for p in params.values()]
