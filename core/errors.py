"""Domain errors. Routes never build HTTP responses for these; `api.errors` maps them.

Every message says what happened and what to change. Every error also carries a `code` from
the closed set `ErrorCode` (defined once, with the wire types, so the client maps on the same
values): each class has its default, and a raise may name a finer one (e.g. `InvalidInput(...,
code=ErrorCode.UNSUPPORTED)` for an option this server does not offer).
"""

from __future__ import annotations

from treadle.types.error_code import ErrorCode

__all__ = [
    "AuthenticationFailed",
    "ConfigurationError",
    "DatabaseNotMigrated",
    "ErrorCode",
    "InvalidInput",
    "NotFound",
    "PayloadTooLarge",
    "PermissionDenied",
    "QuotaExceeded",
    "RateLimited",
    "SessionExpired",
    "SpendLimitReached",
    "TreadleError",
]


class TreadleError(Exception):
    """Base class. `category` tells clients whether retrying or changing input can help;
    `code` tells programs what kind of error it is."""

    category: str = "user"
    code: ErrorCode = ErrorCode.INVALID_INPUT

    def __init__(self, message: str, *, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class ConfigurationError(TreadleError):
    category = "server"
    code = ErrorCode.CONFIGURATION_ERROR


class InvalidInput(TreadleError):
    """The request is well-formed HTTP but its content cannot be accepted."""

    code = ErrorCode.INVALID_INPUT


class NotFound(TreadleError):
    """A missing id, or one owned by another tenant (the two are indistinguishable)."""

    code = ErrorCode.NOT_FOUND


class AuthenticationFailed(TreadleError):
    code = ErrorCode.UNAUTHENTICATED


class PermissionDenied(TreadleError):
    code = ErrorCode.PERMISSION_DENIED


class QuotaExceeded(TreadleError):
    code = ErrorCode.QUOTA_EXCEEDED


class SpendLimitReached(TreadleError):
    """New priced work is refused: the tenant's spend in the billing period, or the session's,
    has reached its limit."""

    code = ErrorCode.SPEND_LIMIT_REACHED


class SessionExpired(TreadleError):
    """The session has finished or timed out; its work can no longer continue."""

    code = ErrorCode.SESSION_ENDED


class PayloadTooLarge(TreadleError):
    code = ErrorCode.PAYLOAD_TOO_LARGE


class RateLimited(TreadleError):
    code = ErrorCode.RATE_LIMITED

    def __init__(self, message: str, retry_after_seconds: float) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


class DatabaseNotMigrated(TreadleError):
    category = "server"
    code = ErrorCode.DATABASE_NOT_MIGRATED
