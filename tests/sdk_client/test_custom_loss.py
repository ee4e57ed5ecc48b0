"""Client-side custom losses reduce to forward + weighted cross-entropy (weights = -dC/dlogp)."""

from __future__ import annotations

import pytest

from treadle.client._custom_loss import custom_output, forward_data, surrogate_data
from treadle.types import Datum, ForwardBackwardOutput, ModelInput, TensorData

pytestmark = pytest.mark.unit


def datum(weights: list[float] | None = None) -> Datum:
    inputs: dict[str, object] = {"target_tokens": [5, 6, 7], "advantages": [1.0, 1.0, 1.0]}
    if weights is not None:
        inputs["weights"] = weights
    return Datum(model_input=ModelInput.from_ints([4, 5, 6]), loss_fn_inputs=inputs)  # type: ignore[arg-type]


def test_forward_data_keeps_targets_and_weights_only() -> None:
    with_weights, without = forward_data([datum([0.0, 1.0, 1.0]), datum()])
    assert set(with_weights.loss_fn_inputs) == {"target_tokens", "weights"}
    assert with_weights.loss_fn_inputs["weights"].data == [0.0, 1.0, 1.0]
    assert without.loss_fn_inputs["weights"].data == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="target_tokens"):
        forward_data([Datum(model_input=ModelInput.from_ints([1]), loss_fn_inputs={})])


def test_surrogate_weights_are_the_negative_gradient() -> None:
    torch = pytest.importorskip("torch")
    forward = ForwardBackwardOutput(
        loss_fn_outputs=[{"logprobs": TensorData(data=[-1.0, -2.0, -3.0], dtype="float32")}]
    )

    def squared(data: list[Datum], logprobs: list[object]) -> tuple[object, dict[str, float]]:
        loss = (logprobs[0] ** 2).sum()  # type: ignore[operator]
        return loss, {"n": 1.0}

    backward, metrics, value = surrogate_data([datum()], forward, squared)
    assert value == 14.0 and metrics == {"n": 1.0}
    # d(sum x^2)/dx = 2x, so weights = -2x.
    assert backward[0].loss_fn_inputs["weights"].data == [2.0, 4.0, 6.0]
    assert backward[0].loss_fn_inputs["target_tokens"].data == [5, 6, 7]
    assert torch is not None


def test_custom_output_reports_the_callers_loss() -> None:
    backward = ForwardBackwardOutput(metrics={"loss:sum": 9.0, "tokens:sum": 3.0})
    out = custom_output(backward, {"margin": 0.5}, loss_value=1.25)
    assert out.metrics == {
        "loss:sum": 1.25,
        "surrogate_loss:sum": 9.0,
        "tokens:sum": 3.0,
        "margin": 0.5,
    }
