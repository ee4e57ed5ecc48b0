"""The ranges of the numbers, and the lengths of the ids and names, the protocol carries,
shared by every wire type.

Each range keeps a value inside what the server can store and execute (64-bit and 32-bit
columns, torch seeds) and away from the server's internal markers, so a request outside one is
refused with a 422 that names the field and its range instead of failing later. The treadle
client validates with the same types, so its callers hear about a bad value before anything is
sent. The OpenAPI schema shows each range as `minimum` / `maximum` (`maxLength` for text).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, TypeAlias

from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

MAX_SEQ_ID = 2**53 - 1
"""Largest seq_id of a training request. Larger values belong to the server (its internal
`unload_model` marker sits at 2**62); 2**53 is also the largest integer every JSON client
represents exactly."""

MAX_SAMPLER_SEQ_ID = 2**63 - 1
"""Sampling clients number their requests `clone_id * 1e9 + n` (up to ~1e18): int64."""

MAX_COUNTER = 2**31 - 1
"""Per-session counters (`model_seq_id`, `sampling_session_seq_id`, `custom_loss_seq_id`)."""

MAX_SEED = 2**64 - 1
"""Seeds are unsigned 64-bit integers (the protobuf wire's `uint64`)."""

MAX_TOPK_LOGPROBS = 128
"""Most alternatives per position `topk_prompt_logprobs` may ask for."""

MAX_LEARNING_RATE = 1e3

MAX_OFFSET = 2**31 - 1
"""Largest `offset` of a listing (beyond the last item a page is simply empty)."""

MAX_ID_LENGTH = 128
"""Session, run, sampler and request ids are the server's own, and never longer."""

MAX_MODEL_NAME_LENGTH = 200
MAX_PATH_LENGTH = 512
"""`tinker://` checkpoint paths."""


def _int_range(low: int, high: int) -> Callable[[int], int]:
    def check(value: int) -> int:
        if not low <= value <= high:
            raise PydanticCustomError(
                "int_range",
                "must be an integer from {low} to {high}",
                {"low": low, "high": high},
            )
        return value

    return check


def _int_schema(low: int, high: int) -> Any:
    return Field(json_schema_extra={"minimum": low, "maximum": high})


def _float_range(
    low: float, high: float | None = None, *, low_open: bool = False, high_open: bool = False
) -> Callable[[float], float]:
    """Finite floats from `low` to `high` (None: no upper end); `*_open` excludes that end."""
    left = "(" if low_open else "["
    right = ")" if high_open else "]"
    shown = f"{left}{low:g}, {'∞)' if high is None else f'{high:g}{right}'}"

    def check(value: float) -> float:
        ok = (
            math.isfinite(value)
            and (value > low if low_open else value >= low)
            and (high is None or (value < high if high_open else value <= high))
        )
        if not ok:
            raise PydanticCustomError(
                "float_range", "must be a finite number in {range}", {"range": shown}
            )
        return value

    return check


def _float_schema(
    low: float, high: float | None = None, *, low_open: bool = False, high_open: bool = False
) -> Any:
    schema: dict[str, float] = {("exclusiveMinimum" if low_open else "minimum"): low}
    if high is not None:
        schema["exclusiveMaximum" if high_open else "maximum"] = high
    return Field(json_schema_extra=dict(schema))


TrainingSeqId: TypeAlias = Annotated[
    int, AfterValidator(_int_range(1, MAX_SEQ_ID)), _int_schema(1, MAX_SEQ_ID)
]
"""A training request's place in its run's order: 1, 2, 3, ..."""

UnsetTrainingSeqId: TypeAlias = Annotated[
    int, AfterValidator(_int_range(0, MAX_SEQ_ID)), _int_schema(0, MAX_SEQ_ID)
]
"""As `TrainingSeqId`, with 0 standing for "not set yet" (the client encodes forward_backward
bodies before it numbers them; the server refuses 0)."""

SamplerSeqId: TypeAlias = Annotated[
    int, AfterValidator(_int_range(0, MAX_SAMPLER_SEQ_ID)), _int_schema(0, MAX_SAMPLER_SEQ_ID)
]

SessionCounter: TypeAlias = Annotated[
    int, AfterValidator(_int_range(0, MAX_COUNTER)), _int_schema(0, MAX_COUNTER)
]

Seed: TypeAlias = Annotated[int, AfterValidator(_int_range(0, MAX_SEED)), _int_schema(0, MAX_SEED)]

TopkCount: TypeAlias = Annotated[
    int,
    AfterValidator(_int_range(0, MAX_TOPK_LOGPROBS)),
    _int_schema(0, MAX_TOPK_LOGPROBS),
]

Cursor64: TypeAlias = Annotated[
    int, AfterValidator(_int_range(0, 2**63 - 1)), _int_schema(0, 2**63 - 1)
]
"""A non-negative position or id that the server keeps as int64."""

LearningRate: TypeAlias = Annotated[
    float,
    AfterValidator(_float_range(0, MAX_LEARNING_RATE)),
    _float_schema(0, MAX_LEARNING_RATE),
]
"""0 is allowed: learning-rate schedules end there."""

Beta: TypeAlias = Annotated[
    float, AfterValidator(_float_range(0, 1, high_open=True)), _float_schema(0, 1, high_open=True)
]

Epsilon: TypeAlias = Annotated[
    float, AfterValidator(_float_range(0, low_open=True)), _float_schema(0, low_open=True)
]

NonNegative: TypeAlias = Annotated[float, AfterValidator(_float_range(0)), _float_schema(0)]

# Text the server looks up or stores: a value too long to be one of its ids, model names or
# paths is refused as such, so no answer ever repeats megabytes of it.
ServerId: TypeAlias = Annotated[str, Field(max_length=MAX_ID_LENGTH)]
BaseModelName: TypeAlias = Annotated[str, Field(max_length=MAX_MODEL_NAME_LENGTH)]
CheckpointPathText: TypeAlias = Annotated[str, Field(max_length=MAX_PATH_LENGTH)]
