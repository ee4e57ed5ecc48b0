"""Reading an operation's future: pending (with its queue state), done, or failed (with the
`OpFailure` its row records)."""

from __future__ import annotations

import dataclasses

from sqlalchemy import bindparam, select
from sqlalchemy.engine import Connection

from billing.tables import UsageEvent
from core.errors import NotFound
from core.tables import Operation, OpStatus, SamplingSession, TrainingRun
from scheduler.failures import OpFailure
from treadle.types import QueueState

COST_KEY = "cost_micros"
"""Beside the usage kinds in a result's usage: what the op cost, in micro-units."""


@dataclasses.dataclass(frozen=True)
class FutureState:
    done: bool
    result: bytes | None = None
    result_codec: str | None = None
    failure: OpFailure | None = None
    queue_state: QueueState = "active"
    usage: dict[str, int] | None = None
    """Of a successful result: the op's ledger quantities by kind and their cost in micro-units
    under `COST_KEY` (`{}` when it bills nothing)."""


# Every long-poll reads these: built once, as building a statement and deriving its cache key
# cost more than running it.
_STATE = select(
    Operation.status,
    Operation.result,
    Operation.result_codec,
    Operation.error_code,
    Operation.error_category,
    Operation.error_message,
    Operation.target_id,
).where(Operation.id == bindparam("op_id"), Operation.tenant_id == bindparam("tenant_id"))
_USAGE = select(UsageEvent.kind, UsageEvent.quantity, UsageEvent.amount_micros).where(
    UsageEvent.operation_id == bindparam("op_id")
)
_RUN_HOLDER = select(TrainingRun.worker_id).where(TrainingRun.id == bindparam("target_id"))
_SAMPLER_HOLDER = select(SamplingSession.worker_id).where(
    SamplingSession.id == bindparam("target_id")
)


def read_future(
    db: Connection, tenant_id: str, request_id: str, *, placed: bool = False
) -> FutureState:
    """The op's state. With `placed`, a queued op whose target no worker holds reports
    `paused_capacity` (distributed mode, while no live worker can take it)."""
    row = db.execute(_STATE, {"op_id": request_id, "tenant_id": tenant_id}).one_or_none()
    if row is None:
        raise NotFound(
            f"request {request_id!r} not found; it was never submitted with this key's account"
        )
    status, result, codec, code, category, message, target_id = row
    if status == OpStatus.DONE:
        # Read with the state, in the caller's transaction: the ledger rows are written in the
        # transaction that stores the result, so a done op's usage is complete here.
        events = db.execute(_USAGE, {"op_id": request_id}).all()
        usage = {kind: int(quantity) for kind, quantity, _ in events}
        if events:
            usage[COST_KEY] = sum(int(amount) for _, _, amount in events)
        return FutureState(done=True, result=result, result_codec=codec, usage=usage)
    if status == OpStatus.FAILED:
        return FutureState(done=True, failure=OpFailure.stored(code, category, message))
    if placed and status == OpStatus.QUEUED:
        holder = db.scalar(_RUN_HOLDER, {"target_id": target_id})
        if holder is None:
            holder = db.scalar(_SAMPLER_HOLDER, {"target_id": target_id})
        if holder is None:
            return FutureState(done=False, queue_state="paused_capacity")
    return FutureState(done=False)
