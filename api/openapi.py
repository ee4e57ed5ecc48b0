"""What the OpenAPI document (`/openapi.json`) says beyond what FastAPI infers from signatures.

Every route lists the error statuses it really answers with `error_responses(...)`, all with the
one body `api.errors` writes (`ErrorResponse`), and routes that read their body themselves
describe it with `raw_request_body(...)`. The schemathesis test in
`tests/integration/test_fuzz_openapi.py` holds the document to the responses.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from core.errors import ErrorCode

_DESCRIPTIONS = {
    401: "The API key is missing, malformed, unknown or revoked.",
    402: "The tenant's or the session's spend limit is reached (code `spend_limit_reached`); "
    "the tinker SDK waits until the operator raises it.",
    403: "The key may not do this: its tenant is disabled, a limit of the tenant is reached, or "
    "(downloads) the signed link is invalid or expired.",
    404: "Not found: a missing id and another tenant's id look alike.",
    410: "The session has ended (finished, or expired without heartbeats); start a new one.",
    413: "The request body exceeds this server's size limit; send smaller batches.",
    422: "The request is invalid; `detail` says what to change, and for malformed requests "
    "`errors` lists each problem.",
    429: "Too many requests; retry after `Retry-After` seconds.",
}

_HEADERS: dict[int, dict[str, Any]] = {
    401: {
        "WWW-Authenticate": {
            "description": "`APIKey`: send the key in the X-API-Key header.",
            "schema": {"type": "string"},
        }
    },
    429: {
        "Retry-After": {
            "description": "Seconds to wait before retrying.",
            "schema": {"type": "integer", "minimum": 1},
        }
    },
}


class ErrorResponse(BaseModel):
    """The body of every error answer (see `api.errors`). Other keys may accompany these."""

    model_config = ConfigDict(extra="allow")

    detail: str = Field(description="What went wrong and what to change.")
    category: Literal["user", "server"] = Field(
        description="`user`: change the request; `server`: the operator's side failed."
    )
    code: ErrorCode = Field(
        description="What kind of error, for programs (the `detail` wording may change); "
        "docs/protocol.md lists each code and what a client should do."
    )


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` entries of a route that answers `statuses` with `ErrorResponse`."""
    responses: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": ErrorResponse, "description": _DESCRIPTIONS[status]}
        if status in _HEADERS:
            entry["headers"] = _HEADERS[status]
        responses[status] = entry
    return responses


# Every route that submits an operation: its session or run may be unknown (404), the tenant may
# be at one of its limits (403, 429), and the body too large or invalid (413, 422).
OP_ERRORS = error_responses(401, 402, 403, 404, 413, 422, 429)


# A route answering with a stored file (FileResponse), whose media type follows the file's name.
FILE_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The file's bytes; `Content-Type` follows the file's name.",
        "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}},
    }
}


def install_openapi(app: FastAPI) -> None:
    """Serve the document without FastAPI's stock 422 answers.

    FastAPI adds a 422 with its `HTTPValidationError` body to every route that has parameters,
    unless the route declares its own 422. Treadle's validation errors have the `ErrorResponse`
    body (see `api.errors`), and routes that can fail validation declare them; on the others
    (string path parameters only) the stock answer can never happen.
    """
    build = app.openapi

    def openapi() -> dict[str, Any]:
        fresh = app.openapi_schema is None
        document = build()
        if fresh:
            _drop_stock_validation_answers(document)
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def _drop_stock_validation_answers(document: dict[str, Any]) -> None:
    stock = "#/components/schemas/HTTPValidationError"
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            answer = operation.get("responses", {}).get("422", {})
            if answer.get("content", {}).get("application/json", {}).get("schema") == {
                "$ref": stock
            }:
                del operation["responses"]["422"]
    schemas = document.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)


def raw_request_body(
    *,
    json_schema: dict[str, Any] | type[BaseModel],
    binary_media_types: tuple[str, ...] = (),
    required: bool = True,
    description: str | None = None,
) -> dict[str, Any]:
    """`openapi_extra` for a route that reads `request.body()` itself, so FastAPI sees no body.

    A model's schema is inlined whole (its `$defs` resolved in place): FastAPI only adds the
    models of declared parameters to the document's components.
    """
    schema = json_schema if isinstance(json_schema, dict) else _inlined(json_schema)
    content: dict[str, Any] = {"application/json": {"schema": schema}}
    for media_type in binary_media_types:
        content[media_type] = {"schema": {"type": "string", "format": "binary"}}
    body: dict[str, Any] = {"required": required, "content": content}
    if description is not None:
        body["description"] = description
    return {"requestBody": body}


def _inlined(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    definitions: dict[str, Any] = schema.pop("$defs", {})

    def resolve(node: Any, seen: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [resolve(item, seen) for item in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref.removeprefix("#/$defs/")
            if name in seen:
                raise ValueError(f"{model.__name__} is recursive through {name}; cannot inline it")
            rest = {k: resolve(v, seen) for k, v in node.items() if k != "$ref"}
            return {**resolve(copy.deepcopy(definitions[name]), (*seen, name)), **rest}
        return {k: resolve(v, seen) for k, v in node.items()}

    resolved: dict[str, Any] = resolve(schema, ())
    return resolved
