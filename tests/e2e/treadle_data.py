"""Helpers of the `treadle` SDK's end-to-end tests."""

from __future__ import annotations

from treadle import types

MODEL = "treadle/tiny-1m"


def sft_datum(offset: int = 0, length: int = 24) -> types.Datum:
    tokens = [(7 * i + offset) % 500 + 10 for i in range(length + 1)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * 4 + [1.0] * (length - 4)},
    )
