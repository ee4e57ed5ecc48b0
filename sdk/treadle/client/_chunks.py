"""Splitting large forward_backward batches into requests, and merging their outputs.

A batch is cut into chunks of at most `max_len` datums and about `max_bytes` of protobuf
each (datums are never split). Each chunk is its own request with its own seq id; the server
accumulates their gradients in seq order, so the chunks behave as one batch.

Merging follows the `name:reduction` grammar of metric keys: `sum` adds, `mean` and `slack`
are weighted by each chunk's datum count, `min`/`max` pick, `hash2` adds modulo 2^64, and
`unique` keeps the first value and appends the others as `key_2`, `key_3`, ... A key missing
from some chunk, or with an unknown reduction, is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from treadle.types import (
    METRIC_REDUCTIONS,
    Datum,
    DmelChunk,
    ForwardBackwardOutput,
    ImageAssetPointerChunk,
    ImageChunk,
    TensorData,
)

logger = logging.getLogger("treadle")

_TOKEN_BYTES = 4  # tokens travel as int32
_INDEX_BYTES = 8  # CSR indices travel as int64
_MASK64 = 0xFFFF_FFFF_FFFF_FFFF


def estimate_datum_bytes(datum: Datum) -> int:
    """Approximate protobuf size of one datum (what the chunk byte limit counts)."""
    total = 0
    for chunk in datum.model_input.chunks:
        if isinstance(chunk, DmelChunk):
            total += len(chunk.dmel)
        elif isinstance(chunk, ImageChunk):
            total += len(chunk.data)
        elif isinstance(chunk, ImageAssetPointerChunk):
            total += len(chunk.location)
        else:
            total += len(chunk.tokens) * _TOKEN_BYTES
    return total + sum(_tensor_bytes(t) for t in datum.loss_fn_inputs.values())


def _tensor_bytes(tensor: TensorData) -> int:
    size = len(tensor.data) * (4 if tensor.dtype == "float32" else 8)
    if tensor.sparse_crow_indices is not None:
        size += _INDEX_BYTES * (
            len(tensor.sparse_crow_indices) + len(tensor.sparse_col_indices or [])
        )
    return size


def split_batch(data: Sequence[Datum], max_len: int, max_bytes: int) -> list[list[Datum]]:
    """Consecutive chunks of `data` within both limits (a datum over `max_bytes` goes alone).

    An empty batch yields one empty chunk, so the server reports the problem.
    """
    chunks: list[list[Datum]] = []
    current: list[Datum] = []
    current_bytes = 0
    for datum in data:
        size = estimate_datum_bytes(datum)
        if current and (len(current) >= max_len or current_bytes + size > max_bytes):
            chunks.append(current)
            current, current_bytes = [], 0
        current.append(datum)
        current_bytes += size
    chunks.append(current)
    return chunks


def merge_outputs(results: Sequence[ForwardBackwardOutput]) -> ForwardBackwardOutput:
    """One output for the whole batch: outputs concatenated in order, metrics merged."""
    if len(results) == 1:
        return results[0]
    if not results:
        return ForwardBackwardOutput()
    return ForwardBackwardOutput.model_construct(
        loss_fn_output_type=results[0].loss_fn_output_type,
        loss_fn_outputs=[out for result in results for out in result.loss_fn_outputs],
        metrics=merge_metrics(
            [r.metrics for r in results], [len(r.loss_fn_outputs) for r in results]
        ),
    )


def merge_metrics(metrics: Sequence[dict[str, float]], weights: Sequence[int]) -> dict[str, float]:
    """Merge per-chunk metrics by the reduction named in each key (see the module doc)."""
    if not metrics:
        return {}
    merged: dict[str, float] = {}
    for key in metrics[0]:
        _, _, reduction = key.partition(":")
        if reduction not in METRIC_REDUCTIONS:
            logger.debug("dropping metric %r: unknown reduction", key)
            continue
        if not all(key in m for m in metrics):
            continue
        values = [m[key] for m in metrics]
        if reduction == "sum":
            merged[key] = float(sum(values))
        elif reduction == "mean":
            merged[key] = _weighted_mean(values, weights)
        elif reduction == "slack":
            merged[key] = max(values) - _weighted_mean(values, weights)
        elif reduction == "min":
            merged[key] = min(values)
        elif reduction == "max":
            merged[key] = max(values)
        elif reduction == "hash2":
            merged[key] = float(sum(int(v) & _MASK64 for v in values) & _MASK64)
        else:  # unique: a dict of floats cannot fold them, so keep each under its own key
            merged[key] = values[0]
            merged.update({f"{key}_{i + 2}": v for i, v in enumerate(values[1:])})
    return merged


def _weighted_mean(values: Sequence[float], weights: Sequence[int]) -> float:
    total = sum(weights)
    if total == 0:
        return sum(values) / len(values)
    return sum(v * w for v, w in zip(values, weights, strict=True)) / total
