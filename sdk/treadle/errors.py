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
  * `InvalidArgumentError` - an argument has the wrong type or value, caught at the call before
    anything is sent (also a `TypeError` and a `ValueError`).
  * `UsageError` (`ClientClosedError`) - the client was used in a way that cannot work, e.g.
    after `close()` (also a `RuntimeError`).
  * `MissingDependencyError` - an optional extra is not installed (also an `ImportError`).

An operation refused while it ran with category `user` raises `RequestRejectedError` (both a
`RequestFailedError` and a `BadRequestError`), or `RequestNotFoundError` (both a
`RequestFailedError` and a `NotFoundError`) when what it names does not exist: the same
mistake raises the same class whether the server refused it at submission or while running.
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


class _RequestRefusal(RequestFailedError):
    """A failed operation that is also the `APIStatusError` of the same refusal at submission."""

    status: int = 422
    status_code: int
    body: Any

    def __init__(self, message: str, *, category: str = "user", request_id: str = "") -> None:
        Exception.__init__(self, f"{message} [category={category}]")
        self.message = message
        self.category = category
        self.request_id = request_id
        self.status_code = self.status
        self.body = None


class RequestRejectedError(_RequestRefusal, BadRequestError):  # type: ignore[misc]
    """An accepted operation was refused while it ran because of its input (category `user`).

    Both a `RequestFailedError` and a `BadRequestError`, so `except BadRequestError` catches
    the same mistake whether the server refused it at submission or while running it.
    `status_code` is 422, the status of the same refusal at submission.
    """


class RequestNotFoundError(_RequestRefusal, NotFoundError):  # type: ignore[misc]
    """An accepted operation failed because what it names does not exist (e.g. `load_state`
    of an unknown checkpoint).

    Both a `RequestFailedError` and a `NotFoundError`, like the refusal of the same path by
    `create_training_client_from_state`. `status_code` is 404.
    """

    status = 404


def error_from_failed_request(message: str, category: str, request_id: str) -> RequestFailedError:
    """The exception for an operation the server accepted and then failed."""
    if category != "user":
        return RequestFailedError(message, category=category, request_id=request_id)
    if " not found" in message.lower():
        return RequestNotFoundError(message, category=category, request_id=request_id)
    return RequestRejectedError(message, category=category, request_id=request_id)


class FutureExpiredError(TreadleError):
    """The server no longer holds this request's result; submit the operation again."""


class InvalidArgumentError(TreadleError, TypeError, ValueError):
    """An argument has the wrong type or value; raised at the call, before anything is sent.

    The message names the call, the argument, what was expected and what was given, e.g.
    `optim_step: adam_params expected AdamParams, got float`.
    """


class UsageError(TreadleError, RuntimeError):
    """The client was used in a way that cannot work (e.g. a blocking call from its own loop)."""


class ClientClosedError(UsageError):
    """The client, or the ServiceClient it came from, is closed; create a new ServiceClient."""


class MissingDependencyError(TreadleError, ImportError):
    """An optional extra is not installed; the message names the `pip install` to run."""


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
