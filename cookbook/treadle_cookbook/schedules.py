"""Learning-rate schedules: a linear warm-up, then constant, linear or cosine decay.

A schedule is part of a recipe's config (`--schedule.kind cosine --schedule.warmup_steps 5`)
and a pure function of the step, so a resumed run continues on the same curve.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Schedule(BaseModel):
    """How the learning rate moves from step 0 to the last step."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["constant", "linear", "cosine"] = Field(
        default="constant", description="after warm-up: stay, or decay linearly or by cosine"
    )
    warmup_steps: int = Field(default=0, ge=0, description="steps rising linearly from 0")
    min_ratio: float = Field(
        default=0.0, ge=0.0, le=1.0, description="the decay's floor, as a share of the peak"
    )

    def learning_rate(self, peak: float, step: int, total_steps: int) -> float:
        """The learning rate of `step` (0-based) out of `total_steps`, peaking at `peak`."""
        if step < self.warmup_steps:
            return peak * (step + 1) / (self.warmup_steps + 1)
        if self.kind == "constant":
            return peak
        decay_steps = max(1, total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        if self.kind == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return peak * (self.min_ratio + (1.0 - self.min_ratio) * shape)
