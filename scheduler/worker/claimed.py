"""A claimed operation, as the executor and recovery see it (no database session attached)."""

from __future__ import annotations

import dataclasses

from core.tables import Operation
from scheduler.ops import OpKind


@dataclasses.dataclass(frozen=True)
class FailedForwardBackward:
    """A forward_backward whose gradients an optimizer step would miss."""

    request_id: str
    seq_id: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Task:
    id: str
    kind: OpKind
    tenant_id: str
    session_id: str
    target_id: str
    seq_id: int | None
    payload: bytes
    payload_codec: str
    base_model: str
    api_key_id: str | None = None
    """The API key that submitted the op (None for ops submitted before keys were recorded)."""
    sampler_version_id: str | None = None
    live_run_id: str | None = None
    """Of a sample on a live sampler: the training run whose current weights it samples."""
    failed_gradients: tuple[FailedForwardBackward, ...] | None = None
    """Of an optim_step: the failed forward_backward ops in its window, when looked up as it
    was claimed (None: not looked up)."""

    @classmethod
    def of(
        cls,
        op: Operation,
        base_model: str,
        sampler_version_id: str | None = None,
        failed_gradients: tuple[FailedForwardBackward, ...] | None = None,
        live_run_id: str | None = None,
    ) -> Task:
        return cls(
            id=op.id,
            kind=OpKind(op.kind),
            tenant_id=op.tenant_id,
            session_id=op.session_id,
            target_id=op.target_id,
            seq_id=op.seq_id,
            payload=op.payload,
            payload_codec=op.payload_codec,
            base_model=base_model,
            api_key_id=op.api_key_id,
            sampler_version_id=sampler_version_id,
            live_run_id=live_run_id,
            failed_gradients=failed_gradients,
        )
