"""Checkpoints and training runs as the REST endpoints list them, and tinker:// paths.

A checkpoint path reads `tinker://{training_run_id}/{kind}/{name}` with kind `weights`
(checkpoint_type `training`), `sampler_weights` (`sampler`) or `external_weights`
(`external`); the checkpoint id is `{kind}/{name}`. Names are 1-255 characters from letters,
digits, `.`, `_` and `-`, not starting with `.` (`CheckpointName`), so they sit safely in paths,
URLs and file names.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Literal, TypeAlias

from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

from treadle.errors import InvalidArgumentError
from treadle.types._base import WireRequest, WireResponse
from treadle.types.bounds import CheckpointPathText
from treadle.types.optimizer import AdamOptimizerConfig, OptimizerConfig

CheckpointType: TypeAlias = Literal["training", "sampler", "external"]

TINKER_SCHEME = "tinker://"
_KIND_TO_TYPE: dict[str, CheckpointType] = {
    "weights": "training",
    "sampler_weights": "sampler",
    "external_weights": "external",
}
_TYPE_TO_KIND: dict[CheckpointType, str] = {v: k for k, v in _KIND_TO_TYPE.items()}

MAX_CHECKPOINT_NAME = 255
_NAME = re.compile(rf"[A-Za-z0-9_-][A-Za-z0-9._-]{{0,{MAX_CHECKPOINT_NAME - 1}}}")


def checkpoint_name_problem(name: str) -> str | None:
    """What is wrong with `name` as a checkpoint name, or None when it is fine."""
    if _NAME.fullmatch(name):
        return None
    # Repeat little of a name that may be long or hold control characters.
    shown = repr(name[:40] + "…" if len(name) > 40 else name)
    return (
        f"checkpoint name {shown} is not allowed; use 1-{MAX_CHECKPOINT_NAME} characters from "
        "letters, digits, '.', '_' and '-', not starting with '.' (e.g. 'step-5' or '000010')"
    )


def _checked_name(name: str) -> str:
    problem = checkpoint_name_problem(name)
    if problem is not None:
        # Through the context, so braces in the name are never read as a template.
        raise PydanticCustomError("checkpoint_name", "{problem}", {"problem": problem})
    return name


CheckpointName: TypeAlias = Annotated[
    str,
    AfterValidator(_checked_name),
    Field(
        json_schema_extra={
            "pattern": f"^{_NAME.pattern}$",
            "minLength": 1,
            "maxLength": MAX_CHECKPOINT_NAME,
        }
    ),
]
"""The name part of a checkpoint path, as save requests carry it."""


class CheckpointPath(WireResponse):
    """A parsed `tinker://{run}/{kind}/{name}` path."""

    training_run_id: str
    checkpoint_type: CheckpointType
    name: str

    @property
    def checkpoint_id(self) -> str:
        return f"{_TYPE_TO_KIND[self.checkpoint_type]}/{self.name}"

    @property
    def tinker_path(self) -> str:
        return f"{TINKER_SCHEME}{self.training_run_id}/{self.checkpoint_id}"

    @classmethod
    def parse(cls, path: str) -> CheckpointPath:
        """Raises:
        InvalidArgumentError: the path is not `tinker://{run}/{weights|sampler_weights|external_weights}/{name}`.
        """
        parts = path[len(TINKER_SCHEME) :].split("/") if path.startswith(TINKER_SCHEME) else []
        if len(parts) != 3 or not all(parts) or parts[1] not in _KIND_TO_TYPE:
            raise InvalidArgumentError(
                f"{path!r} is not a checkpoint path; expected "
                "tinker://<training_run_id>/<weights|sampler_weights|external_weights>/<name>"
            )
        return cls(training_run_id=parts[0], checkpoint_type=_KIND_TO_TYPE[parts[1]], name=parts[2])

    @classmethod
    def build(cls, training_run_id: str, checkpoint_type: CheckpointType, name: str) -> str:
        return cls(
            training_run_id=training_run_id, checkpoint_type=checkpoint_type, name=name
        ).tinker_path


class Checkpoint(WireResponse):
    checkpoint_id: str
    checkpoint_type: CheckpointType
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: datetime | None = None
    """None: never expires."""


class Cursor(WireResponse):
    offset: int
    limit: int
    total_count: int


class CheckpointsListResponse(WireResponse):
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


class TrainingRun(WireResponse):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: datetime
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None
    """Set at create_model / load_weights; the tinker cookbook keeps `renderer_name` here."""


class TrainingRunsResponse(WireResponse):
    training_runs: list[TrainingRun]
    cursor: Cursor


class WeightsInfoRequest(WireRequest):
    tinker_path: CheckpointPathText


class WeightsInfoResponse(WireResponse):
    base_model: str
    optimizer_config: OptimizerConfig = Field(default_factory=AdamOptimizerConfig)
    is_lora: bool
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None


class ExternalWeightsUrlsResponse(WireResponse):
    urls: dict[str, str]
    """Signed URL per file, keyed by its path relative to the checkpoint root."""
    expires: datetime


class SetCheckpointTtlRequest(WireRequest):
    ttl_seconds: int | None
    """1 hour to 10 years; null removes the expiry."""
