"""Why an operation failed: one value from where the failure is known to the future's answer.

An `OpFailure` is built once, where a failure is found (an engine error, a domain error, a
request refused at submission, the worker giving up on an op), written onto the operation's
row by `record`, and read back by `scheduler.futures` for the client, so the failure is
translated into the wire's terms in one place. `code` is its machine-readable kind (one of
`ErrorCode`), `category` says whose side must act, `message` what to change.

It deliberately does not set the operation's status: the callers own their state changes.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from core.errors import ErrorCode, TreadleError
from core.tables import Operation
from gpu_worker import protocol as ep

Category = Literal["user", "server"]


@dataclasses.dataclass(frozen=True)
class OpFailure:
    code: ErrorCode
    category: Category
    message: str

    @classmethod
    def user(cls, message: str, code: ErrorCode = ErrorCode.INVALID_INPUT) -> OpFailure:
        """The request's own fault: the message says what to change."""
        return cls(code, "user", message)

    @classmethod
    def server(cls, message: str) -> OpFailure:
        """The server's fault: the client can only retry or tell the operator."""
        return cls(ErrorCode.INTERNAL_ERROR, "server", message)

    @classmethod
    def of(cls, exc: TreadleError) -> OpFailure:
        """A domain error raised while the op was checked, run or recorded."""
        category: Category = "user" if exc.category == "user" else "server"
        return cls(exc.code, category, exc.message)

    @classmethod
    def of_input(cls, exc: Exception) -> OpFailure:
        """Input the engine's checks or the wire decoder refused."""
        if isinstance(exc, ep.UnsupportedInput):
            return cls.user(str(exc), ErrorCode.UNSUPPORTED)
        return cls.user(str(exc))

    @classmethod
    def of_engine(cls, error: ep.OpError) -> OpFailure:
        """One op's error out of an engine batch."""
        if error.category != "user":
            return cls.server(error.message)
        if error.unsupported:
            return cls.user(error.message, ErrorCode.UNSUPPORTED)
        return cls.user(error.message)

    @classmethod
    def stored(cls, code: str | None, category: str | None, message: str | None) -> OpFailure:
        """A failure read back from an operation's row. Rows failed before codes were stored
        have none: theirs follows from the category, as it would have been recorded."""
        text = message or "the operation failed"
        if category == "user":
            return cls(_known(code, ErrorCode.INVALID_INPUT), "user", text)
        return cls(_known(code, ErrorCode.INTERNAL_ERROR), "server", text)


class Refused(Exception):
    """Raised while an op is prepared or run: it fails with `failure`, whatever kind it is
    (where `gpu_worker.protocol.UserInputError` can only say invalid input)."""

    def __init__(self, failure: OpFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def _known(code: str | None, default: ErrorCode) -> ErrorCode:
    try:
        return ErrorCode(code) if code is not None else default
    except ValueError:
        return default


def record(op: Operation, failure: OpFailure) -> None:
    """Write `failure` onto the operation's row (its status is the caller's to set)."""
    op.error_code = failure.code.value
    op.error_category = failure.category
    op.error_message = failure.message
