"""The one mapping from domain errors to HTTP responses.

Bodies are always JSON (`{"detail": message, "category": ..., "code": ...}`, the code one of
`ErrorCode`'s): the tinker SDK treats a 400 with an empty body as a proxy reset and retries it.
Permanent conditions never use 408/409/429/5xx, which the tinker SDK retries for minutes.
Under `/oai/` (the OpenAI-compatible API) the same errors are written in OpenAI's format,
`{"error": {"message", "type", "param", "code"}}`, and an invalid request is a 400, as OpenAI's
clients expect.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match, Route
from starlette.types import Scope

from api import request_context
from api.refusals import ORDERED_ROUTES, keep_place
from api.validation import describe
from core import errors
from core.errors import ErrorCode

logger = logging.getLogger(__name__)

# What FastAPI says (as a 400) when a JSON body cannot be decoded at all.
_UNPARSEABLE_BODY = "There was an error parsing the body"

STATUS_BY_ERROR: dict[type[errors.TreadleError], int] = {
    errors.AuthenticationFailed: 401,
    # The tinker SDK waits out a 402 ("billing pause") instead of failing.
    errors.SpendLimitReached: 402,
    errors.PermissionDenied: 403,
    errors.QuotaExceeded: 403,
    errors.NotFound: 404,
    errors.SessionExpired: 410,
    errors.PayloadTooLarge: 413,
    errors.InvalidInput: 422,
    errors.RateLimited: 429,
    errors.DatabaseNotMigrated: 503,
    errors.ConfigurationError: 500,
}


def status_for(exc: errors.TreadleError) -> int:
    for cls in type(exc).__mro__:
        if cls in STATUS_BY_ERROR:
            return STATUS_BY_ERROR[cls]
    return 400


# The code of any other HTTP error the framework raises, by status (else by its class).
_FRAMEWORK_CODES = {
    401: ErrorCode.UNAUTHENTICATED,
    403: ErrorCode.PERMISSION_DENIED,
    404: ErrorCode.NOT_FOUND,
    413: ErrorCode.PAYLOAD_TOO_LARGE,
    429: ErrorCode.RATE_LIMITED,
}


def error_response(
    status: int, code: ErrorCode, message: str, category: str = "user", **extra: object
) -> JSONResponse:
    headers: dict[str, str] = {}
    if status == 401:
        headers["WWW-Authenticate"] = "APIKey"
    # Tell HTTP-layer retries (the tinker SDK honours this header) not to retry permanent errors.
    if status < 500 and status not in (408, 429):
        headers["x-should-retry"] = "false"
    return JSONResponse(
        {"detail": message, "category": category, "code": code.value, **extra},
        status_code=status,
        headers=headers,
    )


OPENAI_PREFIX = "/oai/"

# OpenAI's error `type` by status; anything else of a client's is an `invalid_request_error`.
_OPENAI_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


def for_caller(request: Request, response: JSONResponse, param: str | None = None) -> JSONResponse:
    """The error as the route's clients read errors: Treadle's body, or under `/oai/` OpenAI's
    (`param` names the request parameter at fault), with an invalid request answered 400."""
    return for_path(request.url.path, response, param)


def for_scope(scope: Scope, status: int, code: ErrorCode, message: str) -> JSONResponse:
    """An error a middleware answers before any route runs, in the format of the path's
    clients (`for_caller`)."""
    return for_path(scope.get("path", ""), error_response(status, code, message))


def for_path(path: str, response: JSONResponse, param: str | None = None) -> JSONResponse:
    if not path.startswith(OPENAI_PREFIX):
        return response
    body = json.loads(bytes(response.body))
    status = 400 if response.status_code == 422 else response.status_code
    kind = "server_error" if status >= 500 else _OPENAI_TYPES.get(status, "invalid_request_error")
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length",)}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    error = {"message": body["detail"], "type": kind, "param": param, "code": body["code"]}
    return JSONResponse({"error": error}, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(errors.TreadleError)
    async def _domain(request: Request, exc: errors.TreadleError) -> JSONResponse:
        status = status_for(exc)
        response = error_response(status, exc.code, exc.message, exc.category)
        if isinstance(exc, errors.RateLimited):
            response.headers["Retry-After"] = str(max(1, int(exc.retry_after_seconds + 0.999)))
        return for_caller(request, response, getattr(exc, "param", None))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Bounded whatever was sent (see api.validation), and never logged: the access log's
        # one line per request is enough for a client's mistake.
        message, problems = describe(exc.errors())
        if request.url.path in ORDERED_ROUTES:
            await run_in_threadpool(
                keep_place,
                request.app.state.treadle,
                request.url.path,
                request.headers.get("x-api-key"),
                exc.body,
                message,
            )
        param = _first_param(exc.errors())
        return for_caller(
            request, error_response(422, ErrorCode.INVALID_INPUT, message, errors=problems), param
        )

    @app.exception_handler(StarletteHTTPException)
    async def _routing(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """No such path, or a method the path does not take: the same body as every error."""
        path = request.url.path
        shown = path if len(path) <= 120 else path[:120] + "…"
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Starlette names only the first route that matched the path; list every method.
            allowed = allowed_methods(request)
            headers["Allow"] = ", ".join(allowed)
            message = f"{request.method} is not allowed on {shown}; use {' or '.join(allowed)}"
            code = ErrorCode.METHOD_NOT_ALLOWED
        elif exc.status_code == 404 and exc.detail == HTTPStatus.NOT_FOUND.phrase:
            message = f"no endpoint at {shown}; /openapi.json lists the endpoints"
            code = ErrorCode.UNKNOWN_ENDPOINT
        elif exc.status_code == 400 and exc.detail == _UNPARSEABLE_BODY:
            # FastAPI could not even decode a JSON body (not UTF-8): invalid like any bad JSON.
            cause = str(exc.__cause__ or "undecodable")[:120]
            return for_caller(
                request,
                error_response(
                    422,
                    ErrorCode.INVALID_INPUT,
                    f"the body is not UTF-8 JSON ({cause}); send JSON text",
                ),
            )
        else:
            message = str(exc.detail)
            code = _FRAMEWORK_CODES.get(exc.status_code, ErrorCode.INVALID_INPUT)
            if exc.status_code >= 500:
                code = ErrorCode.INTERNAL_ERROR
        response = error_response(exc.status_code, code, message)
        response.headers.update(headers)
        return for_caller(request, response)

    @app.exception_handler(DataError)
    async def _unstorable(request: Request, exc: DataError) -> JSONResponse:
        # PostgreSQL text cannot hold NUL, so an id or name carrying one is refused as the
        # client's mistake; the transaction it came in was rolled back whole.
        if "NUL" in str(exc.orig):
            return for_caller(
                request,
                error_response(
                    422,
                    ErrorCode.INVALID_INPUT,
                    "a text value holds a NUL character (\\u0000), which cannot be stored; "
                    "remove it",
                ),
            )
        return await _unexpected(request, exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        request_id = request_context.request_id_in(request.scope)
        logger.exception(
            "unhandled error in request %s", request_id, extra={"request_id": request_id}
        )
        response = for_caller(
            request,
            error_response(
                500,
                ErrorCode.INTERNAL_ERROR,
                "internal server error; the operator's logs have the details",
                "server",
            ),
        )
        # Answered outside the middleware that gives every other answer its request id.
        if request_id is not None:
            response.headers[request_context.HEADER] = request_id
        return response


def _first_param(problems: Iterable[Any]) -> str | None:
    """The request parameter the first validation problem is about (`messages.0.content`)."""
    for problem in problems:
        location = [str(part) for part in problem.get("loc", ()) if part not in ("body",)]
        if location:
            return ".".join(location)
    return None


def allowed_methods(request: Request, routes: Iterable[BaseRoute] | None = None) -> list[str]:
    """Every method some route takes at the request's path."""
    methods: set[str] = set()
    for route in request.app.router.routes if routes is None else routes:
        # FastAPI keeps an included router whole (its routes carry the router's prefix).
        included = getattr(route, "original_router", None)
        if included is not None:
            methods.update(allowed_methods(request, included.routes))
        elif isinstance(route, Route) and route.methods:
            match, _ = route.matches(request.scope)
            if match is not Match.NONE:
                methods |= route.methods
    return sorted(methods)
