"""One log line per op the worker host records (logger `treadle.ops`): which op, whose, how it
ended, how long it queued and ran, and on which worker.

The line is written once the record committed, from the same `RecordedOp` the metrics count,
so a record rolled back logs nothing and every recorded op logs one line. The op's id is the
`request_id` of its future, which the API's access line for the request that submitted it also
carries (`op_id`): that is how the two are joined, as the op row keeps no id of the HTTP
request.
"""

from __future__ import annotations

import logging

from scheduler.failures import OpFailure
from scheduler.metrics import RecordedOp
from scheduler.worker.claimed import Task

log = logging.getLogger("treadle.ops")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _text(task: Task, outcome: str, fields: dict[str, object]) -> str:
    """`op <id> optim_step on <run> done in 12.3 ms (queued 1.0 ms, 13.3 ms end to end) ...`."""
    execution = fields["execution_ms"]
    queued = fields["queue_wait_ms"]
    timing = (
        f"{fields['end_to_end_ms']} ms end to end, never started"
        if execution is None
        else f"in {execution} ms (queued {queued} ms, {fields['end_to_end_ms']} ms end to end)"
    )
    return (
        f"op {task.id} {task.kind.value} on {task.target_id} {outcome} {timing} "
        f"tenant={task.tenant_id} worker={fields['worker_id']}"
    )


def log_recorded(task: Task, recorded: RecordedOp, error: OpFailure | None, worker_id: str) -> None:
    """Log the line of an op whose record committed; `error` is its failure, None when done."""
    fields: dict[str, object] = {
        "op_id": task.id,
        "op_kind": task.kind.value,
        "target_id": task.target_id,
        "tenant_id": task.tenant_id,
        "outcome": "done" if error is None else "failed",
        "queue_wait_ms": _ms(recorded.queue_wait_seconds),
        "execution_ms": _ms(recorded.execution_seconds),
        "end_to_end_ms": _ms(recorded.end_to_end_seconds),
        "worker_id": worker_id,
    }
    outcome = "done"
    if error is not None:
        fields["error_code"] = error.code.value
        fields["error_category"] = recorded.failed_category
        outcome = f"failed ({error.code.value}, {recorded.failed_category})"
    log.info("%s", _text(task, outcome, fields), extra=fields)
