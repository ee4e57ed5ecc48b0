"""The closed set of error codes: documented once in docs/protocol.md, each produced somewhere,
and an operation's failure kept whole from where it is found to where it is read back."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from core import errors
from core.errors import ErrorCode
from gpu_worker import protocol as ep
from scheduler.failures import OpFailure
from scheduler.ops import REFUSED, encode_json_payload, refusal_of, refused

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _documented_codes() -> list[str]:
    """The first column of the table under "## Error codes" in docs/protocol.md."""
    text = (ROOT / "docs" / "protocol.md").read_text()
    section = text.split("\n## Error codes\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header, rule, *body = rows
    assert header.split("|")[1].strip() == "code" and set(rule) <= {"|", "-", " "}
    return [row.split("|")[1].strip().strip("`") for row in body]


def test_the_protocol_docs_list_every_code_once() -> None:
    documented = _documented_codes()
    assert len(documented) == len(set(documented))
    assert set(documented) == {code.value for code in ErrorCode}


def test_every_code_is_produced_by_the_server() -> None:
    """A code nothing raises or answers has no place in the set."""
    sources = "\n".join(
        path.read_text()
        for package in ("api", "core", "scheduler")
        for path in (ROOT / package).rglob("*.py")
    )
    used = set(re.findall(r"ErrorCode\.([A-Z_]+)", sources))
    assert used == {code.name for code in ErrorCode}


def test_each_domain_error_class_has_its_own_code() -> None:
    assert errors.NotFound("x").code is ErrorCode.NOT_FOUND
    assert errors.SessionExpired("x").code is ErrorCode.SESSION_ENDED
    assert errors.InvalidInput("x", code=ErrorCode.UNSUPPORTED).code is ErrorCode.UNSUPPORTED
    assert errors.InvalidInput("x").code is ErrorCode.INVALID_INPUT  # the override is per raise


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        (OpFailure.of(errors.NotFound("gone")), (ErrorCode.NOT_FOUND, "user")),
        (OpFailure.of(errors.QuotaExceeded("full")), (ErrorCode.QUOTA_EXCEEDED, "user")),
        (OpFailure.of(errors.ConfigurationError("bad")), (ErrorCode.CONFIGURATION_ERROR, "server")),
        (OpFailure.of_input(ep.UserInputError("bad")), (ErrorCode.INVALID_INPUT, "user")),
        (OpFailure.of_input(ep.UnsupportedInput("no")), (ErrorCode.UNSUPPORTED, "user")),
        (OpFailure.of_engine(ep.OpError("user", "bad")), (ErrorCode.INVALID_INPUT, "user")),
        (
            OpFailure.of_engine(ep.OpError.of_input(ep.UnsupportedInput("no"))),
            (ErrorCode.UNSUPPORTED, "user"),
        ),
        (OpFailure.of_engine(ep.OpError("server", "oom")), (ErrorCode.INTERNAL_ERROR, "server")),
    ],
)
def test_failures_keep_their_kind(failure: OpFailure, expected: tuple[ErrorCode, str]) -> None:
    assert (failure.code, failure.category) == expected


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        (("not_found", "user", "m"), OpFailure(ErrorCode.NOT_FOUND, "user", "m")),
        (("internal_error", "server", "m"), OpFailure(ErrorCode.INTERNAL_ERROR, "server", "m")),
        # Rows failed before codes were stored: the category decides.
        ((None, "user", "m"), OpFailure(ErrorCode.INVALID_INPUT, "user", "m")),
        ((None, "server", "m"), OpFailure(ErrorCode.INTERNAL_ERROR, "server", "m")),
        ((None, None, None), OpFailure(ErrorCode.INTERNAL_ERROR, "server", "the operation failed")),
        (("no_such_code", "user", "m"), OpFailure(ErrorCode.INVALID_INPUT, "user", "m")),
    ],
)
def test_stored_failures_read_back(
    row: tuple[str | None, str | None, str | None], expected: OpFailure
) -> None:
    assert OpFailure.stored(*row) == expected


def test_a_refusal_keeps_its_code_and_old_refusals_read_as_invalid_input() -> None:
    data, codec = encode_json_payload(refused("checkpoint x not found", ErrorCode.NOT_FOUND))
    assert refusal_of(data, codec) == OpFailure.user("checkpoint x not found", ErrorCode.NOT_FOUND)
    old, codec = encode_json_payload({REFUSED: "datum 0 lacks weights"})
    assert refusal_of(old, codec) == OpFailure.user("datum 0 lacks weights")
    other, codec = encode_json_payload({"base_model": "m"})
    assert refusal_of(other, codec) is None
