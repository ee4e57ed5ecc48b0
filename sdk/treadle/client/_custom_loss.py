"""Client-side custom losses, reduced to what the server computes (forward + weighted CE).

For a loss C(logprobs) computed in torch on the client, the server's cross-entropy
L = sum(-logprobs * weights) has the same gradient when weights = -dC/dlogprobs. So a custom
loss is: a forward pass for the per-token logprobs, C and its gradient here, then one
forward_backward with those weights. torch is imported only when a custom loss runs
(`pip install 'treadle[torch]'`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from treadle.errors import InvalidArgumentError, MissingDependencyError
from treadle.types import Datum, ForwardBackwardOutput, TensorData

CustomLossFn = Callable[[list[Datum], list[Any]], tuple[Any, dict[str, float]]]
"""`(data, logprobs) -> (loss, metrics)`: `logprobs[i]` is a torch tensor shaped like datum
i's `target_tokens`, requiring grad; `loss` is a scalar torch tensor."""


def import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise MissingDependencyError(
            "forward_backward_custom runs your loss in torch on this machine; install it with "
            "`pip install 'treadle[torch]'`"
        ) from exc
    return torch


def forward_data(data: Sequence[Datum]) -> list[Datum]:
    """The data of the forward pass: targets, and the caller's weights or zeros.

    Raises:
        InvalidArgumentError: a datum has no `target_tokens`.
    """
    out = []
    for i, datum in enumerate(data):
        targets = datum.loss_fn_inputs.get("target_tokens")
        if targets is None:
            raise InvalidArgumentError(
                f"datum {i} has no target_tokens; forward_backward_custom needs them to compute "
                "per-token logprobs"
            )
        weights = datum.loss_fn_inputs.get("weights")
        if weights is None:
            weights = TensorData(
                data=[0.0] * len(targets.data), dtype="float32", shape=targets.shape
            )
        out.append(
            datum.model_copy(
                update={"loss_fn_inputs": {"target_tokens": targets, "weights": weights}}
            )
        )
    return out


def surrogate_data(
    data: Sequence[Datum], forward: ForwardBackwardOutput, loss_fn: CustomLossFn
) -> tuple[list[Datum], dict[str, float], float]:
    """Run the caller's loss on the forward logprobs; returns the backward data, the caller's
    metrics and the loss value.

    Raises:
        InvalidArgumentError: the loss produced no gradient for some datum's logprobs.
    """
    torch = import_torch()
    logprobs = []
    for out in forward.loss_fn_outputs:
        values = out["logprobs"]
        tensor = torch.tensor(values.dense_values(), dtype=torch.float32).reshape(
            values.dense_shape
        )
        logprobs.append(tensor.requires_grad_(True))
    loss, metrics = loss_fn(list(data), logprobs)
    loss_value = float(loss.detach().sum().item())
    loss.backward()
    backward = []
    for i, (datum, logprob) in enumerate(zip(data, logprobs, strict=True)):
        if logprob.grad is None:
            raise InvalidArgumentError(
                f"the custom loss does not depend on the logprobs of datum {i}; every datum "
                "must contribute to the loss"
            )
        weights = TensorData.from_torch(-logprob.grad)
        backward.append(
            datum.model_copy(
                update={
                    "loss_fn_inputs": {
                        "target_tokens": datum.loss_fn_inputs["target_tokens"],
                        "weights": weights,
                    }
                }
            )
        )
    return backward, {k: float(v) for k, v in metrics.items()}, loss_value


def custom_output(
    backward: ForwardBackwardOutput, metrics: dict[str, float], loss_value: float
) -> ForwardBackwardOutput:
    """The backward pass's output with the caller's loss and metrics in place of the surrogate's.

    `loss:sum` becomes the custom loss; the cross-entropy surrogate stays as
    `surrogate_loss:sum`. Caller metrics may be free-form names.
    """
    merged = dict(backward.metrics)
    surrogate = merged.pop("loss:sum", None)
    merged.update(metrics)
    merged["loss:sum"] = loss_value
    if surrogate is not None:
        merged["surrogate_loss:sum"] = surrogate
    return ForwardBackwardOutput.model_construct(
        loss_fn_output_type=backward.loss_fn_output_type,
        loss_fn_outputs=backward.loss_fn_outputs,
        metrics=merged,
    )
