"""What an operation left to record: its result or its failure, its usage, what it adds to its
run's counters, and the database writes that belong to the result (a registered checkpoint, a
run becoming active), which the worker host runs in the same transaction that stores the
result."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session as OrmSession

from billing.ledger import UsageLine
from core.runs import NO_PROGRESS, Progress
from scheduler.failures import OpFailure
from scheduler.ops import JSON

if TYPE_CHECKING:
    from pydantic import BaseModel


@dataclasses.dataclass
class Outcome:
    result: bytes | None = None
    codec: str | None = None
    error: OpFailure | None = None
    usage: list[UsageLine] = dataclasses.field(default_factory=list)
    apply: Callable[[OrmSession], object] | None = None
    progress: Progress = NO_PROGRESS
    """Of a success: what it adds to its training run's counters, written with the run's
    advance (`oplog.advance_run`)."""

    @classmethod
    def failed(cls, failure: OpFailure) -> Outcome:
        return cls(error=failure)

    @classmethod
    def json(
        cls,
        model: BaseModel,
        usage: list[UsageLine] | None = None,
        apply: Callable[[OrmSession], object] | None = None,
        progress: Progress = NO_PROGRESS,
    ) -> Outcome:
        body = model.model_dump_json(exclude_none=True).encode()
        return cls(result=body, codec=JSON, usage=usage or [], apply=apply, progress=progress)
