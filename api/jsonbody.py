"""Checks on JSON request bodies that run before anything parses them.

* Nesting depth. Python's JSON parser, pydantic and the error handler all recurse once per
  level, so a few kilobytes of brackets would otherwise end in a RecursionError (a 500) somewhere
  down the line. No request of the protocol needs more than a handful of levels; user metadata
  and telemetry event data get room to spare.
* Escapes of unpaired UTF-16 surrogates, which Python's parser turns into strings that cannot
  be encoded as UTF-8 (nor stored).
* `NaN`, `Infinity` and `-Infinity`, which Python's parser accepts although JSON has no such
  tokens: stored, they break PostgreSQL's JSON columns and every JSON encoder downstream.

Both run over the raw bytes at C speed (regular expressions, bytes methods, numpy; no Python loop
per byte), and only on JSON bodies.
"""

from __future__ import annotations

import re

import numpy as np
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import for_scope
from core.errors import ErrorCode

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects accepted in a JSON body."""

# A JSON string literal, escapes included; brackets inside strings are text, not structure.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# Keep only brackets, with objects read as arrays: only the depth matters here.
_BRACKETS_ONLY = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_NON_FINITE = re.compile(rb"NaN|Infinity")
_CHUNK = 1 << 20
# A UTF-16 surrogate written as an escape; a high one followed by a low one is one character.
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE_PAIR = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def _outside_strings(body: bytes) -> bytes:
    return _STRING.sub(b"", body) if b'"' in body else body


def has_non_finite(body: bytes) -> bool:
    """Whether the JSON text `body` holds a NaN or Infinity token (outside string literals)."""
    if b"NaN" not in body and b"Infinity" not in body:
        return False
    return _NON_FINITE.search(_outside_strings(body)) is not None


def has_lone_surrogate(body: bytes) -> bool:
    """Whether the JSON text `body` escapes half of a UTF-16 surrogate pair (`"\\ud800"`): Python
    decodes it into a string that no database or encoder accepts."""
    if b"\\u" not in body or _SURROGATE.search(body) is None:
        return False
    return _SURROGATE.search(_SURROGATE_PAIR.sub(b"", body)) is not None


def nesting_exceeds(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text `body` nests arrays and objects more than `limit` levels deep.

    The running count of open brackets (outside strings) is the depth; numpy sums it a chunk at
    a time, so memory stays small. Malformed bodies get an answer too (the parser refuses them
    afterwards either way).
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    brackets = _outside_strings(body).translate(_BRACKETS_ONLY, _NOT_BRACKETS)
    # A run of limit + 1 openers is too deep at once: this ends the cheap attacks in one scan.
    if b"[" * (limit + 1) in brackets:
        return True
    opens = np.frombuffer(brackets, dtype=np.uint8) == ord("[")
    level = 0
    for start in range(0, opens.size, _CHUNK):
        steps = np.where(opens[start : start + _CHUNK], 1, -1).astype(np.int64)
        depths = np.cumsum(steps) + level
        if int(depths.max()) > limit:
            return True
        level = int(depths[-1])
    return False


def _is_json(scope: Scope) -> bool:
    for name, value in scope.get("headers", []):
        if name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            return media == b"application/json" or media.endswith(b"+json")
    return False


def body_problem(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """Why the JSON body cannot be accepted as it is, or None."""
    if nesting_exceeds(body, max_depth):
        return (
            f"the JSON body nests arrays and objects more than {max_depth} levels deep; flatten it"
        )
    if has_non_finite(body):
        return (
            "the JSON body holds NaN or Infinity, which JSON does not allow; send finite numbers "
            "(or null)"
        )
    if has_lone_surrogate(body):
        return (
            "the JSON body escapes an unpaired UTF-16 surrogate (\\ud800-\\udfff), which is not "
            "a character; send valid Unicode text"
        )
    return None


class JsonBodyGuard:
    """Answers 422 to a JSON body that `body_problem` refuses; passes everything else on.

    The body is read whole before the app sees it (FastAPI reads JSON bodies whole anyway);
    place it inside `BodySizeLimit`, which bounds how much that can be.
    """

    def __init__(self, app: ASGIApp, max_depth: int = MAX_JSON_DEPTH) -> None:
        self.app = app
        self.max_depth = max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left (or a size limit already answered): nothing to do
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = body_problem(body, self.max_depth)
        if problem is not None:
            await for_scope(scope, 422, ErrorCode.INVALID_INPUT, problem)(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
