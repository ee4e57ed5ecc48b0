"""Optimizer identity (fixed when a training run is created) and per-step hyperparameters.

A run picks its optimizer family once, in `create_model` / `load_weights`:
`{"type": "adamw"}` (the default) or `{"type": "dimuon", "version": 1}`. Each `optim_step`
then carries the matching hyperparameters: `adam_params` for AdamW, `optimizer_params` (with
its own `type`) for the others.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeAlias

from pydantic import Field

from treadle.types._base import WireRequest
from treadle.types.bounds import Beta, Epsilon, LearningRate, NonNegative


class AdamOptimizerConfig(WireRequest):
    type: Literal["adamw"] = "adamw"


class DimuonOptimizerConfig(WireRequest):
    type: Literal["dimuon"] = "dimuon"
    version: Literal[1] = 1


OptimizerConfig: TypeAlias = Annotated[
    AdamOptimizerConfig | DimuonOptimizerConfig, Field(discriminator="type")
]


class AdamParams(WireRequest):
    """AdamW hyperparameters for one step. Weight decay is decoupled; 0 clip norm is off.

    Bounds: learning_rate in [0, 1000], beta1 and beta2 in [0, 1), eps > 0, weight_decay and
    grad_clip_norm ≥ 0, all finite.
    """

    learning_rate: LearningRate = 1e-4
    beta1: Beta = 0.9
    beta2: Beta = 0.95
    eps: Epsilon = 1e-12
    weight_decay: NonNegative = 0.0
    grad_clip_norm: NonNegative = 0.0


class DimuonParams(WireRequest):
    """Dimuon hyperparameters for one step (the SDK enforces the same bounds client-side)."""

    type: Literal["dimuon"] = "dimuon"
    learning_rate: float = Field(ge=0)
    grad_clip_norm: float = 0.0
    beta1: float = Field(default=0.9, ge=0, lt=1)
