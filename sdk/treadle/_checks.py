"""Argument checks at the call: a wrong type raises at once, naming what was expected.

Without them a wrong argument fails later and elsewhere (an `AttributeError` deep in the
background loop, a pydantic error about a field the caller never named).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pydantic

from treadle.errors import InvalidArgumentError

T = TypeVar("T")


def _names(expected: type | tuple[type, ...]) -> str:
    kinds = expected if isinstance(expected, tuple) else (expected,)
    # An optional argument's None goes unsaid: the caller passed something else on purpose.
    return " or ".join(kind.__name__ for kind in kinds if kind is not type(None))


def check_type(call: str, name: str, value: object, expected: type | tuple[type, ...]) -> None:
    """Raise InvalidArgumentError unless `value` is an instance of `expected`."""
    # bool is an int to isinstance, never to a caller who passed True for a count.
    wrong_bool = (
        isinstance(value, bool) and int in _tuple(expected) and bool not in _tuple(expected)
    )
    if wrong_bool or not isinstance(value, expected):
        raise InvalidArgumentError(
            f"{call}: {name} expected {_names(expected)}, got {type(value).__name__}"
        )


def _tuple(expected: type | tuple[type, ...]) -> tuple[type, ...]:
    return expected if isinstance(expected, tuple) else (expected,)


def check_items(call: str, name: str, values: object, item: type) -> None:
    """Raise InvalidArgumentError unless `values` is a list or tuple of `item`."""
    if not isinstance(values, (list, tuple)):
        raise InvalidArgumentError(
            f"{call}: {name} expected a list of {item.__name__}, got {type(values).__name__}"
        )
    for index, value in enumerate(values):
        if not isinstance(value, item):
            raise InvalidArgumentError(
                f"{call}: {name}[{index}] expected {item.__name__}, got {type(value).__name__}"
            )


def check_callable(call: str, name: str, value: object) -> None:
    """Raise InvalidArgumentError unless `value` can be called."""
    if not callable(value):
        raise InvalidArgumentError(
            f"{call}: {name} expected a function, got {type(value).__name__}"
        )


def build(call: str, factory: Callable[..., T], **fields: Any) -> T:
    """`factory(**fields)`, with a validation error turned into InvalidArgumentError."""
    try:
        return factory(**fields)
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or 'value'}: {error['msg']}"
            for error in exc.errors()
        )
        raise InvalidArgumentError(f"{call}: {problems}") from exc


def optional(expected: type | tuple[type, ...]) -> tuple[type, ...]:
    """`expected` or None."""
    return (*_tuple(expected), type(None))


__all__ = ["build", "check_callable", "check_items", "check_type", "optional"]
