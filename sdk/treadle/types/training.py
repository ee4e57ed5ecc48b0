"""Training-run wire types: create a run, describe it, forward/backward, optimizer steps.

A training run is what the Tinker protocol calls a "model"; its id has the form
`{session_id}:train:{n}`. Every op on a run carries a `seq_id` (1, 2, 3, ... per run) and the
server executes them in that order.

`ForwardBackwardRequest` and `ForwardBackwardOutput` are the Python-side forms of messages that
travel as protobuf (see `treadle.wire`); the rest are plain JSON.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias, get_args

from pydantic import Field, field_validator, model_validator

from treadle.types._base import WireRequest, WireResponse
from treadle.types.bounds import (
    BaseModelName,
    Seed,
    ServerId,
    SessionCounter,
    TrainingSeqId,
    UnsetTrainingSeqId,
)
from treadle.types.datum import Datum
from treadle.types.optimizer import (
    AdamOptimizerConfig,
    AdamParams,
    DimuonParams,
    OptimizerConfig,
)
from treadle.types.tensor import TensorData

LossFnType: TypeAlias = Literal[
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
    "gspo",
    "stable_reinforce",
    "custom",
]
"""The loss names of the Tinker API. `TrainingClient.forward_backward`'s docstring lists the
`loss_fn_inputs` each needs; this server refuses `stable_reinforce` and `custom`."""
LOSS_FNS: tuple[str, ...] = get_args(LossFnType)

METRIC_REDUCTIONS: frozenset[str] = frozenset(
    {"mean", "sum", "min", "max", "slack", "hash2", "unique"}
)
"""Reductions the tinker SDK knows when merging forward_backward metrics across chunks."""


class LoraConfig(WireRequest):
    rank: int
    seed: Seed | None = None
    """Seed for the adapter's initialisation; None lets the server choose."""
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModelRequest(WireRequest):
    session_id: ServerId
    model_seq_id: SessionCounter
    """Per-session counter from 0, shared with create-via-load; the run id ends with it."""
    base_model: BaseModelName
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = Field(default_factory=AdamOptimizerConfig)
    type: Literal["create_model"] = "create_model"


class CreateModelResponse(WireResponse):
    model_id: str
    type: Literal["create_model"] = "create_model"


class GetInfoRequest(WireRequest):
    model_id: ServerId
    type: Literal["get_info"] = "get_info"


class ModelData(WireResponse):
    arch: str | None = None
    model_name: str | None = None
    """The base model name. The tinker SDK needs it (tokenizer, samplers): always set it."""
    tokenizer_id: str | None = None
    """Hugging Face tokenizer repo; clients drop anything from the first `:` on."""


class GetInfoResponse(WireResponse):
    model_id: str
    model_data: ModelData
    optimizer_config: OptimizerConfig = Field(default_factory=AdamOptimizerConfig)
    is_lora: bool | None = None
    lora_rank: int | None = None
    model_name: str | None = None
    type: Literal["get_info"] = "get_info"


class UnloadModelRequest(WireRequest):
    model_id: ServerId
    type: Literal["unload_model"] = "unload_model"


class UnloadModelResponse(WireResponse):
    model_id: str
    type: Literal["unload_model"] = "unload_model"


class ForwardBackwardRequest(WireRequest):
    """A decoded `/forward_backward` body (the wire form is protobuf, see `treadle.wire`).

    `loss_fn` is kept as a plain string so that a server can accept the submission and
    report an unknown loss through the future; `LOSS_FNS` lists the known names.
    """

    model_id: ServerId
    seq_id: UnsetTrainingSeqId
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None = None
    forward_only: bool = False


class ForwardBackwardOutput(WireResponse):
    """The result of a forward or forward_backward op.

    `loss_fn_outputs[i]` holds datum i's per-token tensors (`logprobs` at least, shaped like
    its `target_tokens`). Metric keys must read `name:reduction` with a reduction from
    `METRIC_REDUCTIONS`: the tinker SDK raises on keys without exactly one colon and drops
    unknown reductions.
    """

    loss_fn_output_type: str = "ArrayRecord"
    loss_fn_outputs: list[dict[str, TensorData]] = Field(default_factory=list)
    metrics: dict[str, float] = Field(default_factory=dict)

    @field_validator("metrics")
    @classmethod
    def _check_metric_keys(cls, metrics: dict[str, float]) -> dict[str, float]:
        for key in metrics:
            name, sep, reduction = key.partition(":")
            if not sep or not name or ":" in reduction or reduction not in METRIC_REDUCTIONS:
                raise ValueError(
                    f"metric key {key!r} must read 'name:reduction' with one colon and a "
                    f"reduction in {sorted(METRIC_REDUCTIONS)}, e.g. 'loss:sum'"
                )
        return metrics


class OptimStepRequest(WireRequest):
    """One optimizer step: exactly one of `adam_params` (AdamW runs) or `optimizer_params`."""

    model_id: ServerId
    seq_id: TrainingSeqId | None = None
    adam_params: AdamParams | None = None
    optimizer_params: DimuonParams | None = None
    type: Literal["optim_step"] = "optim_step"

    @model_validator(mode="after")
    def _one_param_set(self) -> OptimStepRequest:
        if (self.adam_params is None) == (self.optimizer_params is None):
            raise ValueError(
                "send exactly one of adam_params (AdamW runs) or optimizer_params "
                "(other optimizer families)"
            )
        return self

    @property
    def optim_params(self) -> AdamParams | DimuonParams:
        params = self.adam_params if self.adam_params is not None else self.optimizer_params
        assert params is not None  # guaranteed by the validator
        return params


class OptimStepResponse(WireResponse):
    metrics: dict[str, float] | None = None
    """Free-form step metrics (e.g. `grad_norm:mean`); not merged by clients."""
