"""Splitting batches into requests and merging their outputs (`name:reduction` semantics)."""

from __future__ import annotations

import pytest

from treadle.client._chunks import estimate_datum_bytes, merge_metrics, merge_outputs, split_batch
from treadle.types import Datum, ForwardBackwardOutput, ModelInput, TensorData

pytestmark = pytest.mark.unit


def datum(n: int) -> Datum:
    return Datum(
        model_input=ModelInput.from_ints([1] * n),
        loss_fn_inputs={"target_tokens": [2] * n, "weights": [1.0] * n},
    )


def test_split_respects_datum_count_and_bytes() -> None:
    data = [datum(10) for _ in range(7)]
    assert [len(c) for c in split_batch(data, max_len=3, max_bytes=10**9)] == [3, 3, 1]
    size = estimate_datum_bytes(data[0])
    assert size == 10 * 4 + 10 * 8 + 10 * 4  # int32 tokens, int64 targets, float32 weights
    assert [len(c) for c in split_batch(data, max_len=100, max_bytes=2 * size)] == [2, 2, 2, 1]
    # A datum larger than the byte limit travels alone rather than not at all.
    assert [len(c) for c in split_batch([datum(1000), datum(1)], 100, 10)] == [1, 1]
    assert split_batch([], 4, 100) == [[]]


def test_metrics_merge_by_reduction() -> None:
    chunks = [
        {
            "loss:sum": 1.0,
            "acc:mean": 0.5,
            "lo:min": 3.0,
            "hi:max": 1.0,
            "gap:slack": 1.0,
            "h:hash2": 2.0**64 - 1,
            "tag:unique": 7.0,
            "only:sum": 1.0,
            "odd:median": 1.0,
        },
        {
            "loss:sum": 2.0,
            "acc:mean": 1.0,
            "lo:min": 2.0,
            "hi:max": 4.0,
            "gap:slack": 3.0,
            "h:hash2": 2.0,
            "tag:unique": 8.0,
        },
    ]
    merged = merge_metrics(chunks, weights=[1, 3])
    assert merged["loss:sum"] == 3.0
    assert merged["acc:mean"] == pytest.approx((0.5 * 1 + 1.0 * 3) / 4)
    assert merged["lo:min"] == 2.0 and merged["hi:max"] == 4.0
    assert merged["gap:slack"] == pytest.approx(3.0 - (1.0 + 9.0) / 4)
    assert merged["h:hash2"] == float((2**64 + 2) & (2**64 - 1))
    assert merged["tag:unique"] == 7.0 and merged["tag:unique_2"] == 8.0
    assert "only:sum" not in merged and "odd:median" not in merged


def test_merge_outputs_concatenates_in_order() -> None:
    def out(values: list[float], loss: float) -> ForwardBackwardOutput:
        return ForwardBackwardOutput(
            loss_fn_outputs=[{"logprobs": TensorData(data=[v], dtype="float32")} for v in values],
            metrics={"loss:sum": loss},
        )

    merged = merge_outputs([out([1.0, 2.0], 1.0), out([3.0], 2.0)])
    assert [o["logprobs"].data for o in merged.loss_fn_outputs] == [[1.0], [2.0], [3.0]]
    assert merged.metrics == {"loss:sum": 3.0}
    single = out([1.0], 5.0)
    assert merge_outputs([single]) is single
