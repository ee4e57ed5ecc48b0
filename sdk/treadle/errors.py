"""Exceptions raised by the treadle client.

Each class says what happened; the message is the server's own (`detail` of its JSON error
body), which says what to change. The class is chosen by the error's `code` (one of
`treadle.types.ErrorCode`, exposed as `.code`), never by the message's wording; an answer
without a code (an older server, a proxy) is classed by its HTTP status alone. The hierarchy:

* `TreadleError` - everything this package raises on purpose.
  * `APIConnectionError` (`APITimeoutError`) - the server could not be reached or did not
    answer in time, after the retries for transient failures ran out.
  * `APIStatusError` - the server answered with an HTTP error. Subclasses by meaning:
    `BadRequestError` (400/422), `AuthenticationError` (401), `PermissionDeniedError` (403),
    `QuotaExceededError` (403 with code `quota_exceeded`; `SpendLimitReachedError`: 402, code
    `spend_limit_reached`), `NotFoundError` (404),
    `SessionExpiredError` (410, code `session_ended`), `PayloadTooLargeError` (413),
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
`RequestFailedError` and a `NotFoundError`) when what it names does not exist (code
`not_found`): the same mistake raises the same class whether the server refused it at
submission or while running.
"""

from __future__ import annotations

from typing import Any

import httpx

from treadle.types.error_code import ErrorCode


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
        code: the server's error code (an `ErrorCode` when this client knows it), or None
            when the answer carried none (an older server, a proxy).
        body: the decoded JSON body, or None when it was not JSON.
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        category: str | None = None,
        code: str | None = None,
        body: Any = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(f"{message} (HTTP {status_code})")
        self.message = message
        self.status_code = status_code
        self.category = category
        self.code = code
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


class SpendLimitReachedError(QuotaExceededError):
    """402: the tenant's spend limit for the billing period, or the session's, is reached.

    Work already accepted still finishes; new priced work is refused until the operator raises
    the limit (`treadle-server admin tenants set-limit`) or a new billing period starts.
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
        code: the server's error code (an `ErrorCode` when this client knows it), or None when
            the server sent none.
        request_id: the failed request.
    """

    def __init__(
        self,
        message: str,
        *,
        category: str = "unknown",
        code: str | None = None,
        request_id: str = "",
    ) -> None:
        super().__init__(f"{message} [category={category}]")
        self.message = message
        self.category = category
        self.code = code
        self.request_id = request_id


class _RequestRefusal(RequestFailedError):
    """A failed operation that is also the `APIStatusError` of the same refusal at submission."""

    status: int = 422
    status_code: int
    body: Any

    def __init__(
        self,
        message: str,
        *,
        category: str = "user",
        code: str | None = None,
        request_id: str = "",
    ) -> None:
        Exception.__init__(self, f"{message} [category={category}]")
        self.message = message
        self.category = category
        self.code = code
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
    """An accepted operation failed because what it names does not exist (code `not_found`,
    e.g. `load_state` of an unknown checkpoint).

    Both a `RequestFailedError` and a `NotFoundError`, like the refusal of the same path by
    `create_training_client_from_state`. `status_code` is 404.
    """

    status = 404


def error_from_failed_request(
    message: str, category: str, request_id: str, code: str | None = None
) -> RequestFailedError:
    """The exception for an operation the server accepted and then failed.

    `category` says whose side must act (only `user` failures are refusals of the request);
    `code` says what kind of refusal: `not_found` raises `RequestNotFoundError`, any other (or
    none, from an older server) `RequestRejectedError`.
    """
    known = _known_code(code)
    kept = known if known is not None else code
    if category != "user":
        return RequestFailedError(message, category=category, code=kept, request_id=request_id)
    cls = RequestNotFoundError if known is ErrorCode.NOT_FOUND else RequestRejectedError
    return cls(message, category=category, code=kept, request_id=request_id)


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


# The class of each code. Every `ErrorCode` is here (a test holds it to the enum).
CLASS_BY_CODE: dict[ErrorCode, type[APIStatusError]] = {
    ErrorCode.INVALID_INPUT: BadRequestError,
    ErrorCode.UNSUPPORTED: BadRequestError,
    ErrorCode.HOST_NOT_ALLOWED: BadRequestError,
    ErrorCode.NOT_FOUND: NotFoundError,
    ErrorCode.UNKNOWN_ENDPOINT: NotFoundError,
    ErrorCode.METHOD_NOT_ALLOWED: APIStatusError,
    ErrorCode.UNAUTHENTICATED: AuthenticationError,
    ErrorCode.PERMISSION_DENIED: PermissionDeniedError,
    ErrorCode.QUOTA_EXCEEDED: QuotaExceededError,
    ErrorCode.SPEND_LIMIT_REACHED: SpendLimitReachedError,
    ErrorCode.SESSION_ENDED: SessionExpiredError,
    ErrorCode.PAYLOAD_TOO_LARGE: PayloadTooLargeError,
    ErrorCode.RATE_LIMITED: RateLimitError,
    ErrorCode.DATABASE_NOT_MIGRATED: InternalServerError,
    ErrorCode.CONFIGURATION_ERROR: InternalServerError,
    ErrorCode.INTERNAL_ERROR: InternalServerError,
}

# The class of an answer without a known code, by HTTP status (5xx: InternalServerError).
_CLASS_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    402: SpendLimitReachedError,
    403: PermissionDeniedError,
    404: NotFoundError,
    410: SessionExpiredError,
    413: PayloadTooLargeError,
    422: BadRequestError,
    429: RateLimitError,
}


def error_from_response(response: httpx.Response) -> APIStatusError:
    """The exception that describes an HTTP error response."""
    status = response.status_code
    body: Any = None
    message = response.text.strip() or response.reason_phrase or f"HTTP {status}"
    category: str | None = None
    code: str | None = None
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
        raw_code = body.get("code")
        code = raw_code if isinstance(raw_code, str) else None
    known = _known_code(code)
    cls = CLASS_BY_CODE[known] if known is not None else _class_for_status(status)
    return cls(
        message,
        status_code=status,
        category=category,
        code=known if known is not None else code,
        body=body,
    )


def _known_code(code: str | None) -> ErrorCode | None:
    """`code` as an `ErrorCode`; None when absent or unknown to this client (a newer server)."""
    if code is None:
        return None
    try:
        return ErrorCode(code)
    except ValueError:
        return None


def _class_for_status(status: int) -> type[APIStatusError]:
    if status >= 500:
        return InternalServerError
    return _CLASS_BY_STATUS.get(status, APIStatusError)
