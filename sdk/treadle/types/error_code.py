"""The closed set of machine-readable error codes, shared by the server and the client.

Every error answer of the server carries one of these as `code`, beside its message (`detail`,
or `error` in a failed operation's future) and its `category`: the message is for people and
may change wording between releases; the code is for programs and does not. The client picks
its exception classes on the code alone. A newer server may send a code this list lacks, so
readers treat an unknown code as absent (and fall back on the HTTP status).
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    INVALID_INPUT = "invalid_input"
    """The request's content cannot be accepted; the message says what to change."""
    UNSUPPORTED = "unsupported"
    """The request asks for something this server does not offer (an optimizer, an option)."""
    NOT_FOUND = "not_found"
    """A named id, path or checkpoint does not exist, or belongs to another tenant."""
    UNKNOWN_ENDPOINT = "unknown_endpoint"
    """No endpoint at the request's path: a wrong base URL, or an older server."""
    METHOD_NOT_ALLOWED = "method_not_allowed"
    """The endpoint exists but takes other HTTP methods (listed in `Allow`)."""
    HOST_NOT_ALLOWED = "host_not_allowed"
    """The request named a host (the `Host` header) this server does not answer for."""
    UNAUTHENTICATED = "unauthenticated"
    """The API key is missing, malformed, unknown or revoked."""
    PERMISSION_DENIED = "permission_denied"
    """The key is valid but may not do this (a disabled tenant, an admin endpoint, a bad or
    expired download link)."""
    QUOTA_EXCEEDED = "quota_exceeded"
    """A limit of the tenant is reached (sessions, training runs, LoRA size, queued work)."""
    SPEND_LIMIT_REACHED = "spend_limit_reached"
    """The tenant's spend limit for the billing period, or the session's, is reached (HTTP
    402); new priced work waits until the operator raises the limit or a new period starts."""
    SESSION_ENDED = "session_ended"
    """The session has finished or expired without heartbeats; start a new one."""
    PAYLOAD_TOO_LARGE = "payload_too_large"
    """The body exceeds the server's size limit."""
    RATE_LIMITED = "rate_limited"
    """Too many requests at once; retry after `Retry-After` seconds."""
    DATABASE_NOT_MIGRATED = "database_not_migrated"
    """The server's database schema is behind its code; the operator must migrate it."""
    CONFIGURATION_ERROR = "configuration_error"
    """The server is misconfigured; the operator must fix its settings."""
    INTERNAL_ERROR = "internal_error"
    """The server failed; retry, and report it to the operator if it persists."""
