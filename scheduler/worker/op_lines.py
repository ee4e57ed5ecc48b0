"""One log line per op the worker host records (logger `treadle.ops`): which op, whose, how it
ended, how long it queued and ran, and on which worker.

The line is written once the record committed, from the same `RecordedOp` the metrics count,
so a record rolled back logs nothing and every recorded op logs one line: an op the worker ran
(`log_recorded`), and an op given up after its last interrupted attempt when the claim or
release that gave it up committed (`log_given_up`, outcome failed). The op's id is the
`request_id` of its future, which the API's access line for the request that submitted it also
carries (`op_id`): that is how the two are joined, as the op row keeps no id of the HTTP
request.
"""

from __future__ import annotations

import dataclasses
import logging

from core.tables import Operation
from scheduler.failures import OpFailure
from scheduler.metrics import RecordedOp
from scheduler.worker.claimed import Task

log = logging.getLogger("treadle.ops")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


@dataclasses.dataclass(frozen=True)
class GivenUp:
    """What the line and the metrics need of an op given up, read while its transaction is
    open."""

    op_id: str
    kind: str
    target_id: str
    tenant_id: str
    error_code: str
    recorded: RecordedOp

    @classmethod
    def of(cls, op: Operation) -> GivenUp:
        return cls(
            op_id=op.id,
            kind=op.kind,
            target_id=op.target_id,
            tenant_id=op.tenant_id,
            error_code=op.error_code or "",
            recorded=RecordedOp.of(op, ()),
        )


def _text(fields: dict[str, object], outcome: str) -> str:
    """`op <id> optim_step on <run> done in 12.3 ms (queued 1.0 ms, 13.3 ms end to end) ...`."""
    execution = fields["execution_ms"]
    queued = fields["queue_wait_ms"]
    timing = (
        f"{fields['end_to_end_ms']} ms end to end, never started"
        if execution is None
        else f"in {execution} ms (queued {queued} ms, {fields['end_to_end_ms']} ms end to end)"
    )
    return (
        f"op {fields['op_id']} {fields['op_kind']} on {fields['target_id']} {outcome} {timing} "
        f"tenant={fields['tenant_id']} worker={fields['worker_id']}"
    )


def _log(
    op: tuple[str, str, str, str], recorded: RecordedOp, error_code: str | None, worker_id: str
) -> None:
    """`op` is its id, kind, target and tenant; `error_code` None: it is done."""
    op_id, kind, target_id, tenant_id = op
    fields: dict[str, object] = {
        "op_id": op_id,
        "op_kind": kind,
        "target_id": target_id,
        "tenant_id": tenant_id,
        "outcome": "done" if error_code is None else "failed",
        "queue_wait_ms": _ms(recorded.queue_wait_seconds),
        "execution_ms": _ms(recorded.execution_seconds),
        "end_to_end_ms": _ms(recorded.end_to_end_seconds),
        "worker_id": worker_id,
    }
    outcome = "done"
    if error_code is not None:
        fields["error_code"] = error_code
        fields["error_category"] = recorded.failed_category
        outcome = f"failed ({error_code}, {recorded.failed_category})"
    log.info("%s", _text(fields, outcome), extra=fields)


def log_recorded(task: Task, recorded: RecordedOp, error: OpFailure | None, worker_id: str) -> None:
    """Log the line of an op whose record committed; `error` is its failure, None when done."""
    op = (task.id, task.kind.value, task.target_id, task.tenant_id)
    _log(op, recorded, None if error is None else error.code.value, worker_id)


def log_given_up(given: GivenUp, worker_id: str) -> None:
    """Log the line of an op given up, once the claim or release that gave it up committed."""
    op = (given.op_id, given.kind, given.target_id, given.tenant_id)
    _log(op, given.recorded, given.error_code, worker_id)
