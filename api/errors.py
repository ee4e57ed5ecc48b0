"""The one mapping from domain errors to HTTP responses.

Bodies are always JSON (`{"detail": message, "category": ...}`): the tinker SDK treats a 400 with
an empty body as a proxy reset and retries it. Permanent conditions never use 408/409/429/5xx,
which the tinker SDK retries for minutes.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from core import errors

logger = logging.getLogger(__name__)

STATUS_BY_ERROR: dict[type[errors.TreadleError], int] = {
    errors.AuthenticationFailed: 401,
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


def error_response(
    status: int, message: str, category: str = "user", **extra: object
) -> JSONResponse:
    headers: dict[str, str] = {}
    if status == 401:
        headers["WWW-Authenticate"] = "APIKey"
    # Tell HTTP-layer retries (the tinker SDK honours this header) not to retry permanent errors.
    if status < 500 and status not in (408, 429):
        headers["x-should-retry"] = "false"
    return JSONResponse(
        {"detail": message, "category": category, **extra}, status_code=status, headers=headers
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(errors.TreadleError)
    async def _domain(_: Request, exc: errors.TreadleError) -> JSONResponse:
        status = status_for(exc)
        response = error_response(status, exc.message, exc.category)
        if isinstance(exc, errors.RateLimited):
            response.headers["Retry-After"] = str(max(1, int(exc.retry_after_seconds + 0.999)))
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
            problems.append(f"{where}: {err.get('msg')}")
        return error_response(
            422, "invalid request: " + "; ".join(problems), errors=jsonable(exc.errors())
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(
            500, "internal server error; the operator's logs have the details", "server"
        )


def jsonable(value: object) -> object:
    """Validation errors may carry exceptions in `ctx`; keep only JSON-safe parts."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items() if k != "ctx"}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)
