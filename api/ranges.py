"""Byte ranges of HTTP Range requests (RFC 9110 §14) for the routes that serve downloads.

Only a single range is read (`bytes=N-`, `bytes=N-M`, `bytes=-N`); a header this module does not
read (several ranges, another unit, nonsense) is left to the caller, which may serve the whole
body as the RFC allows. A range starting at or beyond the end is refused with 416 and the
body every error has.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi.responses import JSONResponse

from api.errors import error_response
from api.openapi import ErrorResponse
from core.errors import ErrorCode

_SINGLE = re.compile(r"bytes=(\d*)-(\d*)")


# The OpenAPI entries of a route that answers ranges of a body of `what`.
def documented(what: str, media_type: str) -> dict[int | str, dict[str, Any]]:
    body = {media_type: {"schema": {"type": "string", "format": "binary"}}}
    return {
        206: {
            "description": f"The requested byte range of {what} (`Content-Range` says which).",
            "content": body,
        },
        416: {
            "model": ErrorResponse,
            "description": f"The range starts beyond the end of {what}; request one within its "
            "length, which `Content-Range` gives.",
            "headers": {
                "Content-Range": {
                    "description": "`bytes */N`: the body has N bytes.",
                    "schema": {"type": "string"},
                }
            },
        },
    }


def single(header: str | None, size: int) -> tuple[int, int] | None:
    """`(start, end exclusive)` of a single `bytes=` range of a body of `size` bytes, or None
    for no header or one this module does not read. `start` may be `size` or more: refuse
    that with `not_satisfiable`."""
    match = _SINGLE.fullmatch(header.strip()) if header else None
    if match is None or match.group(1) == match.group(2) == "":
        return None
    first, last = match.group(1), match.group(2)
    if first == "":  # the last N bytes
        return max(size - int(last), 0), size
    start = int(first)
    if last != "" and int(last) < start:
        return None
    return start, size if last == "" else min(int(last) + 1, size)


def not_satisfiable(header: str, size: int) -> JSONResponse:
    refused = error_response(
        416,
        ErrorCode.INVALID_INPUT,
        f"range {header!r} starts beyond the {size} bytes there are; request a range that "
        f"starts below {size}",
    )
    refused.headers["Content-Range"] = f"bytes */{size}"
    return refused
