"""Domain errors. Routes never build HTTP responses for these; `api.errors` maps them.

Every message says what happened and what to change.
"""

from __future__ import annotations


class TreadleError(Exception):
    """Base class. `category` tells clients whether retrying or changing input can help."""

    category: str = "user"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigurationError(TreadleError):
    category = "server"


class InvalidInput(TreadleError):
    """The request is well-formed HTTP but its content cannot be accepted."""


class NotFound(TreadleError):
    """A missing id, or one owned by another tenant (the two are indistinguishable)."""


class AuthenticationFailed(TreadleError):
    pass


class PermissionDenied(TreadleError):
    pass


class QuotaExceeded(TreadleError):
    pass


class SessionExpired(TreadleError):
    """The session has finished or timed out; its work can no longer continue."""


class PayloadTooLarge(TreadleError):
    pass


class RateLimited(TreadleError):
    def __init__(self, message: str, retry_after_seconds: float) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


class DatabaseNotMigrated(TreadleError):
    category = "server"
