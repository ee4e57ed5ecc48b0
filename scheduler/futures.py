"""Reading an operation's future: pending (with its queue state), done, or failed."""

from __future__ import annotations

import dataclasses

from sqlalchemy import select
from sqlalchemy.orm import Session as OrmSession

from core.errors import NotFound
from core.tables import Operation
from scheduler.submit import DONE, FAILED


@dataclasses.dataclass(frozen=True)
class FutureState:
    done: bool
    result: bytes | None = None
    result_codec: str | None = None
    error_message: str | None = None
    error_category: str | None = None
    queue_state: str = "active"


def read_future(db: OrmSession, tenant_id: str, request_id: str) -> FutureState:
    row = db.execute(
        select(Operation.status, Operation.result, Operation.result_codec, Operation.error_message,
               Operation.error_category)
        .where(Operation.id == request_id, Operation.tenant_id == tenant_id)
    ).one_or_none()
    if row is None:
        raise NotFound(f"request {request_id!r} not found; it was never submitted with this key's account")
    status, result, codec, message, category = row
    if status == DONE:
        return FutureState(done=True, result=result, result_codec=codec)
    if status == FAILED:
        return FutureState(done=True, error_message=message, error_category=category)
    return FutureState(done=False)
