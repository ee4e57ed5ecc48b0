"""Saving, loading and copying a training run's weights.

Saves are ops in the run's `seq_id` order and resolve through futures to `tinker://` paths:
`tinker://{run}/weights/{name}` (adapter + optimizer state, resumable),
`tinker://{run}/sampler_weights/{name}` (adapter for sampling) and
`tinker://{run}/external_weights/{name}` (an export for use outside Treadle).
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

from pydantic import model_validator

from treadle.types._base import WireRequest, WireResponse
from treadle.types.bounds import (
    BaseModelName,
    CheckpointPathText,
    ServerId,
    SessionCounter,
    TrainingSeqId,
)
from treadle.types.checkpoints import CheckpointName
from treadle.types.optimizer import OptimizerConfig

SamplingClientKind: TypeAlias = Literal["snapshot", "inflight"]
"""`snapshot` freezes the saved weights; `inflight` publishes mutable weights shared by every
inflight sampler of the run."""


class SaveWeightsRequest(WireRequest):
    model_id: ServerId
    path: CheckpointName | None = None
    """Checkpoint name (not a full path)."""
    seq_id: TrainingSeqId | None = None
    ttl_seconds: int | None = None
    """1 hour to 10 years; None keeps the checkpoint until deleted."""
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None
    type: Literal["save_weights"] = "save_weights"


class SaveWeightsResponse(WireResponse):
    path: str
    type: Literal["save_weights"] = "save_weights"


class SaveWeightsForSamplerRequest(WireRequest):
    """Named save (`path` set) or ephemeral save that opens a sampling session (no `path`,
    `sampling_session_seq_id` set)."""

    model_id: ServerId
    path: CheckpointName | None = None
    sampling_session_seq_id: SessionCounter | None = None
    kind: SamplingClientKind = "snapshot"
    seq_id: TrainingSeqId | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None
    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"


class SaveWeightsForSamplerResponse(WireResponse):
    """`path` is required when the request named the checkpoint, `sampling_session_id` when
    it did not: the tinker SDK asserts both."""

    path: str | None = None
    sampling_session_id: str | None = None
    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"


class SaveWeightsExternalRequest(WireRequest):
    model_id: ServerId
    path: CheckpointName
    """Export name (required)."""
    seq_id: TrainingSeqId | None = None
    ttl_seconds: int | None = None
    age_encryption_recipients: list[str] | None = None
    """age recipients (`age1...` or SSH public keys) to encrypt each exported file to."""
    merged: bool | None = None
    """Treadle extension: export a Hugging Face model folder with the adapter merged into the
    base weights instead of a PEFT adapter folder (the tinker SDK never sets it)."""
    type: Literal["save_weights_external"] = "save_weights_external"


class SaveWeightsExternalResponse(WireResponse):
    path: str
    size_bytes: int | None = None
    type: Literal["save_weights_external"] = "save_weights_external"


class LoadWeightsRequest(WireRequest):
    """Load a checkpoint, addressed one of two ways.

    * create-via-load: `session_id` + `model_seq_id` create a new run from the checkpoint
      (the load is its implicit seq 0; its id is `{session_id}:train:{model_seq_id}`).
    * legacy: `model_id` + `seq_id` load into an existing run as one of its ops.
    """

    model_id: ServerId | None = None
    seq_id: TrainingSeqId | None = None
    session_id: ServerId | None = None
    model_seq_id: SessionCounter | None = None
    base_model: BaseModelName | None = None
    user_metadata: dict[str, Any] | None = None
    path: CheckpointPathText
    optimizer: bool
    """Restore the optimizer state too."""
    optimizer_config: OptimizerConfig | None = None
    """Optimizer for a weights-only create-via-load; defaults to AdamW."""
    weights_access_token: str | None = None
    type: Literal["load_weights"] = "load_weights"

    @model_validator(mode="after")
    def _one_addressing(self) -> LoadWeightsRequest:
        creates = self.session_id is not None or self.model_seq_id is not None
        legacy = self.model_id is not None or self.seq_id is not None
        if creates == legacy:
            raise ValueError(
                "address load_weights with either session_id + model_seq_id (create a run "
                "from the checkpoint) or model_id + seq_id (load into an existing run)"
            )
        if creates and (self.session_id is None or self.model_seq_id is None):
            raise ValueError("create-via-load needs both session_id and model_seq_id")
        if legacy and self.model_id is None:
            raise ValueError("loading into an existing run needs model_id")
        return self

    @property
    def creates_model(self) -> bool:
        return self.session_id is not None


class LoadWeightsResponse(WireResponse):
    path: str | None = None
    model_id: str | None = None
    type: Literal["load_weights"] = "load_weights"


class CopyWeightsRequest(WireRequest):
    """Copy a checkpoint into a project, or into a new run slot of a session."""

    source_path: CheckpointPathText
    destination_project_id: str | None = None
    session_id: ServerId | None = None
    model_seq_id: SessionCounter | None = None
    ttl_seconds: int | None = None
    weights_access_token: str | None = None

    @model_validator(mode="after")
    def _one_destination(self) -> CopyWeightsRequest:
        by_session = self.session_id is not None and self.model_seq_id is not None
        if (self.session_id is None) != (self.model_seq_id is None):
            raise ValueError("copy_weights needs session_id and model_seq_id together")
        if by_session and self.destination_project_id is not None:
            raise ValueError(
                "give copy_weights either destination_project_id or session_id + "
                "model_seq_id, not both"
            )
        return self


class CopyWeightsResponse(WireResponse):
    tinker_path: str
