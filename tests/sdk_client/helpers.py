"""Helpers of the SDK client tests: a fast retry policy and a small datum."""

from __future__ import annotations

from treadle import types
from treadle._http import RetryPolicy

FAST = RetryPolicy(initial_backoff_seconds=0.001, max_backoff_seconds=0.01, max_elapsed_seconds=5)


def datum(n: int = 3) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(list(range(1, n + 1))),
        loss_fn_inputs={"target_tokens": list(range(2, n + 2)), "weights": [1.0] * n},
    )
