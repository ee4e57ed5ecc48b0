"""The byte-level checks on JSON bodies and the bounded description of validation errors,
against independent references: nesting measured on the parsed value, echoes measured in bytes."""

from __future__ import annotations

import json
import math
import random

import pytest

from api.jsonbody import MAX_JSON_DEPTH, body_problem, has_non_finite, nesting_exceeds
from api.validation import MAX_ECHO_BYTES, MAX_PROBLEMS, describe, preview

pytestmark = pytest.mark.unit


def _depth(value: object) -> int:
    """Nesting depth of a parsed JSON value, without recursion (the reference)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in children)
    return deepest


def _random_value(rng: random.Random, depth: int) -> object:
    kind = rng.random()
    if depth == 0 or kind < 0.3:
        return rng.choice([1, -2.5, True, None, "a[{b", 'q"[', "\\", "]}"])
    children = [_random_value(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    if kind < 0.65:
        return children
    return {f"k{i}[": child for i, child in enumerate(children)}


def _nested(depth: int, leaf: str = "1") -> str:
    text = leaf
    for level in range(depth):
        text = f"[{text}]" if level % 2 else '{"a": ' + text + "}"
    return text


@pytest.mark.parametrize("seed", range(40))
def test_nesting_check_agrees_with_the_parsed_depth(seed: int) -> None:
    rng = random.Random(seed)
    value = _random_value(rng, rng.randint(1, 9))
    body = json.dumps(value).encode()
    depth = _depth(value)
    for limit in range(1, 10):
        assert nesting_exceeds(body, limit) == (depth > limit), (body, limit)


def test_nesting_limit_is_exact_and_strings_do_not_count() -> None:
    assert not nesting_exceeds(_nested(MAX_JSON_DEPTH).encode())
    assert nesting_exceeds(_nested(MAX_JSON_DEPTH + 1).encode())
    # Siblings do not add up: many shallow containers are fine.
    assert not nesting_exceeds(json.dumps([[[1]] * 10_000] * 3).encode())
    brackets_in_text = json.dumps({"text": "[" * 5000 + '\\"{' * 100, "x": [1]}).encode()
    assert not nesting_exceeds(brackets_in_text)
    assert nesting_exceeds(b"[" * 100_000 + b"]" * 100_000)
    # Unbalanced junk is left to the parser rather than reported as deep.
    assert not nesting_exceeds(b"]" * 1000 + b"[" * 10)


def test_non_finite_tokens_are_found_outside_strings_only() -> None:
    assert has_non_finite(b'{"lr": NaN}')
    assert has_non_finite(b'{"x": [1, -Infinity]}')
    assert has_non_finite(b"Infinity")
    assert not has_non_finite(b'{"name": "NaN and Infinity", "s": "\\"NaN"}')
    assert not has_non_finite(json.dumps({"v": [1.5, -2e300, 0]}).encode())
    assert body_problem(b'{"a": NaN}') is not None
    assert body_problem(_nested(MAX_JSON_DEPTH + 1).encode()) is not None
    assert body_problem(json.dumps({"ok": ["NaN", 1]}).encode()) is None


def _error(loc: tuple[object, ...], value: object, msg: str = "bad") -> dict[str, object]:
    return {"type": "value_error", "loc": loc, "msg": msg, "input": value, "ctx": {"e": object()}}


def test_described_errors_are_json_and_bounded_whatever_the_input() -> None:
    huge = "x" * 1_000_000
    deep: object = 1
    for _ in range(5000):
        deep = [deep]
    errors = [
        _error(("body", "lr"), math.nan),
        _error(("body", "eps"), -math.inf),
        _error(("body", huge), huge, msg="Value error, " + huge),
        _error(("body", "big"), 10**400),
        _error(("body",), {"k" * 1000: [huge, {"n": math.inf}], "deep": deep}),
        _error(("body",), b"\xff" * 100_000),
        _error(tuple(["body", *range(100)]), deep),
        *(_error(("body", f"f{i}"), i) for i in range(50)),
    ]
    message, listed = describe(errors)
    text = json.dumps({"detail": message, "errors": listed}, allow_nan=False)
    assert len(listed) == MAX_PROBLEMS and "and 47 more problems" in message
    assert "x" * (MAX_ECHO_BYTES + 1) not in text and "k" * 100 not in text
    assert len(text.encode()) < 16_000
    assert listed[0]["input"] == "NaN" and listed[1]["input"] == "-Infinity"
    assert listed[3]["input"] == "<integer of 1329 bits>"
    assert message.startswith("invalid request: lr: bad; eps: bad; ")


def test_previews_keep_short_finite_values_as_they_are() -> None:
    assert preview(3) == 3 and preview(2.5) == 2.5 and preview(None) is None
    assert preview(True) is True and preview("step-5") == "step-5"
    assert preview(2**64 - 1) == 2**64 - 1
    assert preview({"a": [1, None, False]}) == '{"a": [1, null, false]}'
    assert len(str(preview(list(range(100_000)))).encode()) <= MAX_ECHO_BYTES + 3
