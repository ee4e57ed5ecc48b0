"""Exceptions raised by the treadle client.

Each class says what happened; the message is the server's own (`detail` of its JSON error
body), which says what to change. The hierarchy:

* `TreadleError` - everything this package raises on purpose.
  * `APIConnectionError` (`APITimeoutError`) - the server could not be reached or did not
    answer in time, after the retries for transient failures ran out.
  * `APIStatusError` - the server answered with an HTTP error. Subclasses by meaning:
    `BadRequestError` (400/422), `AuthenticationError` (401), `PermissionDeniedError` (403),
    `QuotaExceededError` (403 session limit, 402 spend cap), `NotFoundError` (404),
    `SessionExpiredError` (410, or 404 on an ended session), `PayloadTooLargeError` (413),
    `RateLimitError` (429), `InternalServerError` (5xx).
  * `RequestFailedError` - an accepted operation failed; `category` is `user` (change the
    input), `server` (the operator's side) or `unknown`.
  * `FutureExpiredError` - the server no longer holds the result of a request.
"""

from __future__ import annotations

from typing import Any

import httpx


class TreadleError(Exception):
    """Base class of every error the treadle client raises on purpose."""


class APIConnectionError(TreadleError):
    """The server could not be reached (connection refused or reset, DNS, TLS)."""


class APITimeoutError(APIConnectionError):
    """The server did not answer within the request's timeout."""


class APIStatusError(TreadleError):
    """The server answered with an HTTP error status.

    Attributes:
        status_code: the HTTP status.
        message: the server's explanation (its `detail`), or the raw body.
        category: the server's error category (`user` or `server`) when it sent one.
        body: the decoded JSON body, or None when it was not JSON.
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        category: str | None = None,
        body: Any = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(f"{message} (HTTP {status_code})")
        self.message = message
        self.status_code = status_code
        self.category = category
        self.body = body
        self.request_id = request_id


class BadRequestError(APIStatusError):
    """400/422: the request's content was refused; the message says what to change."""


class AuthenticationError(APIStatusError):
    """401: the API key is missing, malformed, revoked or unknown."""


class PermissionDeniedError(APIStatusError):
    """403: the key is valid but may not do this."""


class QuotaExceededError(PermissionDeniedError):
    """A tenant quota is exhausted (e.g. the concurrent session limit, or the spend cap).

    Finish another session (`ServiceClient.close()`) or ask the operator to raise the limit.
    """


class NotFoundError(APIStatusError):
    """404: the id does not exist or belongs to someone else (the two look alike)."""


class SessionExpiredError(NotFoundError):
    """The session has finished or timed out; start a new ServiceClient."""


class PayloadTooLargeError(APIStatusError):
    """413: the body exceeds the server's limit; send smaller batches."""


class RateLimitError(APIStatusError):
    """429: the server asked to slow down (retried automatically until the budget runs out)."""


class InternalServerError(APIStatusError):
    """5xx: the server failed (retried automatically until the budget runs out)."""


class RequestFailedError(TreadleError):
    """An accepted operation failed while it ran.

    Attributes:
        message: the server's explanation.
        category: `user` (the input cannot work; change it), `server` (the operator's side) or
            `unknown`. The training run stays usable either way.
        request_id: the failed request.
    """

    def __init__(self, message: str, *, category: str = "unknown", request_id: str = "") -> None:
        super().__init__(f"{message} [category={category}]")
        self.message = message
        self.category = category
        self.request_id = request_id


class FutureExpiredError(TreadleError):
    """The server no longer holds this request's result (HTTP 410 on retrieve_future)."""


_SESSION_ENDED_HINTS = ("has finished", "expired after missing heartbeats", "start a new session")


def error_from_response(response: httpx.Response) -> APIStatusError:
    """The exception that describes an HTTP error response."""
    status = response.status_code
    body: Any = None
    message = response.text.strip() or response.reason_phrase or f"HTTP {status}"
    category: str | None = None
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        detail = body.get("detail", body.get("error"))
        if isinstance(detail, str):
            message = detail
        elif detail is not None:
            message = str(detail)
        raw_category = body.get("category")
        category = raw_category if isinstance(raw_category, str) else None
    cls = _class_for(status, message)
    return cls(message, status_code=status, category=category, body=body)


def _class_for(status: int, message: str) -> type[APIStatusError]:
    lowered = message.lower()
    if status in (400, 422):
        return BadRequestError
    if status == 401:
        return AuthenticationError
    if status == 402:
        return QuotaExceededError
    if status == 403:
        if "limit" in lowered or "quota" in lowered or "spend cap" in lowered:
            return QuotaExceededError
        return PermissionDeniedError
    if status == 404:
        if "session" in lowered and any(hint in lowered for hint in _SESSION_ENDED_HINTS):
            return SessionExpiredError
        return NotFoundError
    if status == 410:
        return SessionExpiredError
    if status == 413:
        return PayloadTooLargeError
    if status == 429:
        return RateLimitError
    if status >= 500:
        return InternalServerError
    return APIStatusError
