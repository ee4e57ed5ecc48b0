"""Splitting work over a worker group's ranks, and merging what they return: forward_backward
batches by datum, sampling requests by sample.

Every loss is a sum over datums, and a datum is never cut (GSPO's sequence ratio is per datum),
so giving each rank a slice of an op's datums is exact: the op's loss, metrics and gradient
are the sums of the ranks' parts, and its per-datum outputs are the ranks' outputs, in order.
Nothing is rescaled. Slices are contiguous (merging is concatenation in rank order) and
balanced by token count, which is what a pass costs. An op with fewer datums than ranks
leaves some ranks without a slice; they skip it.

Ops are sliced after validation (`CheckedOp`): validation looks across an op's datums (clip
thresholds spread to every datum once any sends one), so it runs once, on the whole op.

A sampling request's samples are dealt out by index: a sample's noise is keyed by its index
in the request (`Job.indices`), and rows do not depend on their batch-mates, so the shares
together sample what one engine would. The share holding sample 0 also computes the prompt
logprobs.

Pure: numpy and the protocol types, no torch and no communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from gpu_worker.protocol import (
    ForwardBackwardResult,
    OpError,
    SampledSequence,
    SampleResult,
    Usage,
)
from gpu_worker.validation import CheckedOp


def split_by_tokens(sizes: Sequence[int], world: int) -> list[range]:
    """Cut positions 0..len(sizes) into `world` contiguous ranges, in order, each near
    sum(sizes) / world tokens; a cut goes where it lands closest to its share (ties keep the
    datum on the earlier rank). Ranges are empty where there are fewer datums than ranks."""
    if world < 1:
        raise ValueError(f"world size {world}: a group has at least one rank")
    total = sum(sizes)
    bounds = [0]
    i, used = 0, 0
    for r in range(1, world):
        # compared in integers (scaled by world) so the cuts do not depend on rounding
        target = total * r
        while i < len(sizes) and abs((used + sizes[i]) * world - target) <= abs(
            used * world - target
        ):
            used += sizes[i]
            i += 1
        bounds.append(i)
    bounds.append(len(sizes))
    return [range(bounds[r], bounds[r + 1]) for r in range(world)]


def shard_ops(ops: Sequence[CheckedOp | OpError], world: int) -> list[list[CheckedOp | None]]:
    """Each rank's slice of every op, by rank then op: None where the op was refused or the
    rank got none of its datums."""
    shards: list[list[CheckedOp | None]] = [[] for _ in range(world)]
    for op in ops:
        if isinstance(op, OpError):
            for shard in shards:
                shard.append(None)
            continue
        ranges = split_by_tokens([d.tokens.size for d in op.datums], world)
        for shard, span in zip(shards, ranges, strict=True):
            shard.append(replace(op, datums=op.datums[span.start : span.stop]) if span else None)
    return shards


def merge_result(
    parts: Sequence[ForwardBackwardResult | OpError | None],
) -> ForwardBackwardResult | OpError:
    """One op's result from its ranks' parts, in rank order (None: the rank had no slice).

    The op fails if any part failed (the first failure, in rank order, is its error). Outputs
    are concatenated; `:sum` metrics are added, `:max`/`:min` take the extreme; other
    reductions cannot be combined from parts and raise ValueError.
    """
    for part in parts:
        if isinstance(part, OpError):
            return part
    done = [p for p in parts if isinstance(p, ForwardBackwardResult)]
    if not done:
        raise ValueError("no rank returned a result for this op")
    outputs: list[dict[str, np.ndarray]] = []
    metrics: dict[str, float] = {}
    trained = prefill = sampled = 0
    for part in done:
        outputs.extend(part.loss_fn_outputs)
        for key, value in part.metrics.items():
            metrics[key] = _combine(key, metrics[key], value) if key in metrics else value
        trained += part.usage.trained_tokens
        prefill += part.usage.prefill_tokens
        sampled += part.usage.sampled_tokens
    return ForwardBackwardResult(outputs, metrics, Usage(trained, prefill, sampled))


def _combine(key: str, a: float, b: float) -> float:
    reduction = key.rpartition(":")[2]
    if reduction == "sum":
        return a + b
    if reduction == "max":
        return max(a, b)
    if reduction == "min":
        return min(a, b)
    raise ValueError(f"metric {key!r}: only :sum, :max and :min merge across ranks")


def split_samples(num_samples: int, loads: Sequence[int]) -> list[list[int]]:
    """A request's sample indices by rank. Each sample goes to the rank with the fewest rows
    (its `loads` plus the samples it got here), ties to the lower rank: with equal loads the
    samples are dealt out in turn, and a one-sample request goes to the least-loaded rank."""
    rows = list(loads)
    shares: list[list[int]] = [[] for _ in rows]
    for i in range(num_samples):
        r = min(range(len(rows)), key=lambda r: (rows[r], r))
        shares[r].append(i)
        rows[r] += 1
    return shares


def merge_samples(shares: Sequence[tuple[list[int], SampleResult]]) -> SampleResult:
    """One request's result from its finished shares (each: its sample indices and result).
    Sequences go back by index; the prompt scores and the prefill come from the share holding
    sample 0 (one engine prefills a request once); sampled tokens are added."""
    by_index: dict[int, SampledSequence] = {}
    first: SampleResult | None = None
    sampled = 0
    for indices, result in shares:
        by_index.update(zip(indices, result.sequences, strict=True))
        if 0 in indices:
            first = result
        sampled += result.usage.sampled_tokens
    if first is None or sorted(by_index) != list(range(len(by_index))):
        raise ValueError(f"shares hold samples {sorted(by_index)}, not 0 to n - 1")
    return SampleResult(
        [by_index[i] for i in range(len(by_index))],
        first.prompt_logprobs,
        first.topk_prompt_logprobs,
        Usage(prefill_tokens=first.usage.prefill_tokens, sampled_tokens=sampled),
    )
