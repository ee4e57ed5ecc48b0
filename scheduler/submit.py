"""Submitting operations: ordering checks, dedupe and queue limits before `oplog.queue`.

An operation is keyed by `(target_id, seq_id)`: a resubmission of the same key (the tinker SDK
retries with new idempotency keys) returns the existing request id and never runs twice. The
caller owns the transaction, and wakes the dispatcher once it committed.
"""

from __future__ import annotations

import dataclasses
import logging

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session as OrmSession

from billing import limits as spend_limits
from billing.estimate import Estimate
from billing.ledger import UsageLine
from core import runs
from core.clock import Clock
from core.errors import InvalidInput, NotFound, RateLimited
from core.ids import new_request_id
from core.tables import Operation, Tenant, TrainingRun
from core.tenants import lock_tenant, resource_limits
from scheduler import oplog
from scheduler.failures import OpFailure
from scheduler.ops import OpKind

log = logging.getLogger(__name__)

# What a refusal under a queue limit asks clients to wait: queues drain at the engine's pace.
RETRY_AFTER_SECONDS = 1.0


@dataclasses.dataclass(frozen=True)
class Submitted:
    request_id: str
    duplicate: bool
    queued_kind: str | None = None
    """The kind of a new op left queued; None for a resubmission, and for a request failed as it
    arrived (it never waits in the queue, and no worker records it)."""


def submit(
    db: OrmSession,
    clock: Clock,
    *,
    tenant_id: str,
    session_id: str,
    target_id: str,
    seq_id: int | None,
    kind: OpKind,
    payload: bytes,
    payload_codec: str,
    next_in_order: bool = False,
    api_key_id: str | None = None,
    estimate: Estimate | None = None,
    op_id: str | None = None,
) -> Submitted:
    """Queue an op, or answer a resubmission with the original. `next_in_order` marks the op
    its training run waits for next (see `_admit`); `api_key_id` is the submitting key, whose
    usage the op's is counted as. `estimate` is what the op will use, given when its tenant
    has a spend limit: it is held against the limits (`billing.limits`); unload_model, which
    frees resources, is never held back. `op_id` is the new op's id when the caller chose it
    (`core.ids.new_request_id`) to watch the op's progress before it exists."""
    if seq_id is not None:
        existing = _existing(db, tenant_id, target_id, seq_id, kind)
        if existing is not None:
            return Submitted(existing, duplicate=True)
    locked = _admit(db, tenant_id, kind, next_in_order)
    reserved = 0
    if estimate is not None and kind is not OpKind.UNLOAD_MODEL:
        reserved = spend_limits.reserve(
            db,
            clock,
            locked or lock_tenant(db, tenant_id),
            session_id=session_id,
            target_id=target_id,
            run_seq_id=None if kind is OpKind.SAMPLE else seq_id,
            estimate=estimate,
        )
    request_id = op_id or new_request_id()
    queued = oplog.queue(
        db,
        {
            "id": request_id,
            "tenant_id": tenant_id,
            "session_id": session_id,
            "target_id": target_id,
            "seq_id": seq_id,
            "kind": kind.value,
            "payload": payload,
            "payload_codec": payload_codec,
            "api_key_id": api_key_id,
            "attempts": 0,
            "reserved_micros": reserved,
            "created_at": clock.now(),
        },
    )
    if not queued:
        # A concurrent twin won the race on (target_id, seq_id): answer with its request id.
        assert seq_id is not None  # only a seq_id can conflict
        existing = _existing(db, tenant_id, target_id, seq_id, kind)
        assert existing is not None  # the twin's row is what refused this one
        return Submitted(existing, duplicate=True)
    return Submitted(request_id, duplicate=False, queued_kind=kind.value)


def _admit(db: OrmSession, tenant_id: str, kind: OpKind, next_in_order: bool) -> Tenant | None:
    """Refuse a new op beyond the tenant's queue limits (429: the queue drains by itself, and
    the SDKs resubmit the same request, which keeps its seq_id). The tenant stays locked until
    the transaction ends, so concurrent submissions never overshoot a limit.

    Two kinds of op are always admitted. unload_model frees resources. The op a training run
    waits for next may be what the run's queued ops (arrived out of order) wait for: refusing
    it could only stall them until their gap is given up. At most one such op per live run is
    ever beyond the limit.

    Returns the tenant's locked row, or None when the op was admitted without a look.
    """
    if kind is OpKind.UNLOAD_MODEL or next_in_order:
        return None
    tenant = lock_tenant(db, tenant_id)
    limits = resource_limits(tenant)
    in_flight = (
        select(func.count())
        .select_from(Operation)
        .where(Operation.tenant_id == tenant_id, Operation.status.in_(oplog.IN_FLIGHT))
    )
    queued = db.scalar(in_flight) or 0
    if queued >= limits.max_queued_ops:
        raise RateLimited(
            f"operation queue full: tenant {tenant.name!r} allows {limits.max_queued_ops:,} "
            f"operations queued or running and {queued:,} are; wait for results before "
            "submitting more (the tinker and treadle SDKs retry this request by themselves), or "
            "ask the operator to raise max_queued_ops",
            retry_after_seconds=RETRY_AFTER_SECONDS,
        )
    if kind is OpKind.SAMPLE:
        sampling = db.scalar(in_flight.where(Operation.kind == OpKind.SAMPLE.value)) or 0
        if sampling >= limits.max_sampling_requests:
            raise RateLimited(
                f"sampling limit reached: tenant {tenant.name!r} allows "
                f"{limits.max_sampling_requests:,} sampling requests queued or running and "
                f"{sampling:,} are; wait for results before sending more (the tinker and treadle "
                "SDKs retry this request by themselves), or ask the operator to raise "
                "max_sampling_requests",
                retry_after_seconds=RETRY_AFTER_SECONDS,
            )
    return tenant


# Looked up on every submission: built once, and only the columns the check needs (the op's
# payload can be large).
_AT_SEQ = select(Operation.id, Operation.tenant_id, Operation.kind).where(
    Operation.target_id == bindparam("target_id"), Operation.seq_id == bindparam("seq_id")
)


def _existing(
    db: OrmSession, tenant_id: str, target_id: str, seq_id: int, kind: OpKind
) -> str | None:
    """The id of the op already at (`target_id`, `seq_id`), if any: a resubmission. A foreign
    tenant's op there is a 404, and one of another kind a user error."""
    existing = db.execute(_AT_SEQ, {"target_id": target_id, "seq_id": seq_id}).first()
    if existing is None:
        return None
    if existing.tenant_id != tenant_id:
        raise NotFound(f"{target_id!r} not found")
    if existing.kind != kind.value:
        raise InvalidInput(
            f"seq_id {seq_id} of {target_id} was already used by a {existing.kind} request; "
            "each request of a client needs its own seq_id"
        )
    return existing.id


def submit_training_op(
    db: OrmSession,
    clock: Clock,
    *,
    run: TrainingRun,
    seq_id: int,
    kind: OpKind,
    payload: bytes,
    payload_codec: str,
    api_key_id: str | None = None,
    usage: tuple[UsageLine, ...] | None = None,
) -> Submitted:
    """Submit an op on a training run, in the run's seq order. `usage` is what the op will
    use (empty for a free op), given when its tenant has a spend limit; None admits the op
    whatever the spend.

    A seq_id at or below what the run already executed can only be a resubmission (answered
    with the original request) or a request that arrived after its gap was released, which is
    accepted and failed at once so the client hears why.
    """
    if seq_id < 1:
        raise InvalidInput(f"seq_id {seq_id} is invalid; training requests count seq_id from 1")
    submitted = submit(
        db,
        clock,
        tenant_id=run.tenant_id,
        session_id=run.session_id,
        target_id=run.id,
        seq_id=seq_id,
        kind=kind,
        payload=payload,
        payload_codec=payload_codec,
        next_in_order=seq_id == run.executed_seq_id + 1,
        api_key_id=api_key_id,
        estimate=None if usage is None else Estimate(run.base_model, usage),
    )
    if not submitted.duplicate and seq_id <= run.executed_seq_id:
        op = db.get(Operation, submitted.request_id)
        assert op is not None
        oplog.fail_now(
            op,
            OpFailure.user(
                f"seq_id {seq_id} reached the server after later requests of {run.id} had run (it "
                "was given up on as lost); submit the work again with a new request"
            ),
            clock.now(),
        )
        log.warning("late arrival of seq %s on %s after its gap was released", seq_id, run.id)
        submitted = dataclasses.replace(submitted, queued_kind=None)
    runs.touch(run, clock.now())
    return submitted
