"""Write sdk/docs/api.md, the API reference, from the public classes' docstrings.

Run `python sdk/scripts/gen_api_reference.py` after changing a public signature or docstring;
`tests/sdk_client/test_api_reference.py` fails while the committed file is out of date.
Pass `--check` to only compare.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import treadle
from treadle import errors

OUTPUT = Path(__file__).resolve().parents[1] / "docs" / "api.md"

CLASSES: list[type] = [
    treadle.ServiceClient,
    treadle.TrainingClient,
    treadle.SamplingClient,
    treadle.RestClient,
    treadle.APIFuture,
    treadle.RetryPolicy,
]
ERRORS: list[type] = [
    errors.TreadleError,
    errors.APIConnectionError,
    errors.APITimeoutError,
    errors.APIStatusError,
    errors.BadRequestError,
    errors.AuthenticationError,
    errors.PermissionDeniedError,
    errors.QuotaExceededError,
    errors.NotFoundError,
    errors.SessionExpiredError,
    errors.PayloadTooLargeError,
    errors.RateLimitError,
    errors.InternalServerError,
    errors.RequestFailedError,
    errors.FutureExpiredError,
]


def _doc(obj: object) -> str:
    return inspect.cleandoc(inspect.getdoc(obj) or "").strip()


def _signature(name: str, fn: object) -> str:
    try:
        return f"{name}{inspect.signature(fn)}"  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return name


def _class_section(cls: type) -> list[str]:
    lines = [f"## `{cls.__name__}`", "", f"```python\n{_signature(cls.__name__, cls)}\n```", ""]
    if _doc(cls):
        lines += [_doc(cls), ""]
    for name, member in cls.__dict__.items():
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            lines += [f"### `{cls.__name__}.{name}` (property)", ""]
            if _doc(member):
                lines += [_doc(member), ""]
            continue
        if not callable(member) and not isinstance(member, classmethod | staticmethod):
            continue
        fn = member.__func__ if isinstance(member, classmethod | staticmethod) else member
        lines += [f"### `{cls.__name__}.{name}`", "", f"```python\n{_signature(name, fn)}\n```", ""]
        if _doc(fn):
            lines += [_doc(fn), ""]
    return lines


def render() -> str:
    lines = [
        "# treadle API reference",
        "",
        "Generated from the docstrings by `sdk/scripts/gen_api_reference.py`; do not edit.",
        "Wire types (`Datum`, `ModelInput`, `TensorData`, `SamplingParams`, `AdamParams`,",
        "responses) live in `treadle.types`; see their docstrings.",
        "",
    ]
    for cls in CLASSES:
        lines += _class_section(cls)
    lines += ["# Errors", "", _doc(errors), ""]
    for cls in ERRORS:
        bases = ", ".join(b.__name__ for b in cls.__bases__)
        lines += [f"## `{cls.__name__}({bases})`", "", _doc(cls), ""]
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the file is out of date")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUTPUT.is_file() or OUTPUT.read_text() != text:
            sys.exit(f"{OUTPUT} is out of date; run python {Path(__file__).name}")
        return
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)


if __name__ == "__main__":
    main()
