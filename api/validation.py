"""How a request that fails validation is described back to its sender, within bounds.

Pydantic's errors carry the offending input whole (a 60 MB string, a NaN that JSON cannot
encode, a structure nested hundreds of levels deep) and their messages or locations may repeat
parts of it. The reply names each problem's field and what is wrong, but repeats at most
`MAX_ECHO_BYTES` of the input per problem and lists at most `MAX_PROBLEMS` problems, so its size
is bounded whatever was sent, and it is always valid JSON.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

MAX_ECHO_BYTES = 200
MAX_PROBLEMS = 10
_MAX_LOC_PART = 64
_MAX_LOC_PARTS = 12
_PREVIEW_DEPTH = 4


def clip(text: str, limit: int = MAX_ECHO_BYTES) -> str:
    """`text` cut to at most `limit` UTF-8 bytes (plus a marker when cut)."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    return data[:limit].decode("utf-8", "ignore") + "…"


def _scalar(value: object) -> str | int | float | bool | None:
    """A JSON-safe, bounded stand-in for a scalar input."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        return value
    if isinstance(value, int):
        # Python refuses to print ints of more than 4300 digits; JSON bodies cannot hold them.
        return value if value.bit_length() <= 64 else f"<integer of {value.bit_length()} bits>"
    if isinstance(value, bytes | bytearray):
        return clip(bytes(value[: MAX_ECHO_BYTES * 4]).decode("utf-8", "replace"))
    # Cut before clip() encodes: the input may be megabytes long.
    return clip(str(value)[: MAX_ECHO_BYTES * 4])


def _render(value: object, budget: int, depth: int) -> str:
    """Compact JSON-like text of `value`, stopping once about `budget` characters are out."""
    if isinstance(value, dict | list | tuple):
        if depth >= _PREVIEW_DEPTH:
            return "{…}" if isinstance(value, dict) else "[…]"
        is_dict = isinstance(value, dict)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        parts: list[str] = []
        used = 2
        for key, item in items:
            if used >= budget:
                parts.append("…")
                break
            text = _render(item, budget - used, depth + 1)
            if is_dict:
                text = f"{_render(str(key)[:_MAX_LOC_PART], budget, depth + 1)}: {text}"
            parts.append(text)
            used += len(text) + 2
        inner = ", ".join(parts)
        return "{" + inner + "}" if is_dict else "[" + inner + "]"
    scalar = _scalar(value)
    if isinstance(scalar, str):
        return '"' + scalar[:budget] + '"'
    if scalar is None:
        return "null"
    return str(scalar).lower() if isinstance(scalar, bool) else str(scalar)


def preview(value: object) -> str | int | float | bool | None:
    """The input of one problem as the reply shows it: scalars as themselves when finite and
    short, anything else as text of at most `MAX_ECHO_BYTES` bytes."""
    if isinstance(value, dict | list | tuple):
        return clip(_render(value, MAX_ECHO_BYTES, 0))
    return _scalar(value)


def _location(loc: Sequence[Any]) -> list[str | int]:
    parts: list[str | int] = []
    if len(loc) > _MAX_LOC_PARTS:  # keep the innermost parts, which say the most
        loc = ["…", *loc[-(_MAX_LOC_PARTS - 1) :]]
    for part in loc:
        if isinstance(part, int) and not isinstance(part, bool):
            parts.append(part)
        else:
            parts.append(clip(str(part)[: _MAX_LOC_PART * 4], _MAX_LOC_PART))
    return parts


def describe(errors: Sequence[Any], what: str = "request") -> tuple[str, list[dict[str, object]]]:
    """The reply's message (`invalid {what}: ...`) and its `errors` list for pydantic-style
    `errors`."""
    problems: list[str] = []
    listed: list[dict[str, object]] = []
    for err in errors[:MAX_PROBLEMS]:
        loc = _location(err.get("loc", ()))
        where = clip(".".join(str(p) for p in loc if p != "body")) or "body"
        msg = clip(str(err.get("msg", "invalid value")))
        problems.append(f"{where}: {msg}")
        entry: dict[str, object] = {"type": str(err.get("type", "")), "loc": loc, "msg": msg}
        if "input" in err:
            entry["input"] = preview(err["input"])
        listed.append(entry)
    if len(errors) > MAX_PROBLEMS:
        problems.append(f"and {len(errors) - MAX_PROBLEMS} more problems")
    return f"invalid {what}: " + "; ".join(problems), listed
