"""Datum: one training example (model input plus per-token loss inputs).

`loss_fn_inputs` maps names such as `target_tokens`, `weights`, `logprobs` and `advantages`
to tensors token-aligned with `model_input`. For convenience a Datum also accepts plain lists,
numpy arrays and torch tensors there and turns them into TensorData; plain lists take their
dtype from the key (`target_tokens` is int64, the known float inputs are float32, anything
else is inferred from the values).

Provenance spans tie positions of a datum back to sampled sequences (stable_reinforce); they
travel only in the protobuf forward_backward body.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeAlias

from pydantic import Field, field_validator

from treadle.types._base import WireRequest
from treadle.types.model_input import ModelInput
from treadle.types.tensor import TensorData, TensorDtype

LOSS_INPUT_DTYPES: dict[str, TensorDtype] = {
    "target_tokens": "int64",
    "weights": "float32",
    "advantages": "float32",
    "logprobs": "float32",
    "clip_low_threshold": "float32",
    "clip_high_threshold": "float32",
    "sequence_ratio_mask": "float32",
}


class PromptProvenanceSpan(WireRequest):
    """Positions [offset, offset + length) of the named sequence's request prompt."""

    type: Literal["prompt_tokens"] = "prompt_tokens"
    sequence_id: str = Field(min_length=1)
    offset: int = Field(default=0, ge=0)
    length: int = Field(ge=0)


class SampledProvenanceSpan(WireRequest):
    """Positions [offset, offset + length) of the named sequence's sampled tokens."""

    type: Literal["sampled_tokens"] = "sampled_tokens"
    sequence_id: str = Field(min_length=1)
    offset: int = Field(default=0, ge=0)
    length: int = Field(ge=0)


ProvenanceSpan: TypeAlias = Annotated[
    PromptProvenanceSpan | SampledProvenanceSpan, Field(discriminator="type")
]


class Datum(WireRequest):
    """One training example: the model's input and the per-token inputs of the loss.

    Attributes:
        model_input: the tokens the model reads (`ModelInput.from_ints(tokens[:-1])`).
        loss_fn_inputs: per-position arrays the loss reads, each as long as the input:
            `target_tokens` (the next token at each position) and, depending on the loss,
            `weights`, `logprobs`, `advantages`, `sequence_ratio_mask` (see
            `TrainingClient.forward_backward`). Lists, numpy arrays and torch tensors are
            converted to `TensorData`.
        model_input_spans, loss_fn_input_spans: optional provenance of the tokens.

    ```python
    Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    ```
    """

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = Field(default_factory=dict)
    model_input_spans: list[ProvenanceSpan] | None = None
    loss_fn_input_spans: list[ProvenanceSpan] | None = None

    @field_validator("loss_fn_inputs", mode="before")
    @classmethod
    def _coerce_arrays(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        return {key: _to_tensor_data(key, item) for key, item in value.items()}


def _to_tensor_data(key: str, value: Any) -> Any:
    module = type(value).__module__
    if module.startswith("numpy") and hasattr(value, "dtype"):
        return TensorData.from_numpy(value)
    if module.startswith("torch") and hasattr(value, "dtype"):
        return TensorData.from_torch(value)
    if isinstance(value, list):
        dtype = LOSS_INPUT_DTYPES.get(key) or _infer_dtype(value)
        return TensorData.from_list(value, dtype)
    return value


def _infer_dtype(values: list[Any]) -> TensorDtype:
    flat: list[Any] = values
    while flat and isinstance(flat[0], list):
        flat = [x for row in flat for x in row]
    return "float32" if any(isinstance(x, float) for x in flat) else "int64"
