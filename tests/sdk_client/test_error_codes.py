"""The client picks its exception classes on the server's error `code`, never on its wording.

Every `ErrorCode` has a case here, for HTTP error answers and for failed operations; answers
without a code (an older server, a proxy) are classed by their HTTP status alone.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import treadle
from tests.sdk_client.fake_server import FakeServer
from treadle import errors as sdk_errors
from treadle._http import RetryPolicy
from treadle.errors import error_from_failed_request, error_from_response
from treadle.types import ErrorCode

pytestmark = pytest.mark.unit

FAST = RetryPolicy(initial_backoff_seconds=0.001, max_backoff_seconds=0.01, max_elapsed_seconds=1)

# Each code as the server answers it: (status, category, the class the client raises). The
# message is the same misleading text everywhere, to prove that nothing reads it.
HTTP_CASES: dict[ErrorCode, tuple[int, str, type[treadle.APIStatusError]]] = {
    ErrorCode.INVALID_INPUT: (422, "user", treadle.BadRequestError),
    ErrorCode.UNSUPPORTED: (422, "user", treadle.BadRequestError),
    ErrorCode.HOST_NOT_ALLOWED: (400, "user", treadle.BadRequestError),
    ErrorCode.NOT_FOUND: (404, "user", treadle.NotFoundError),
    ErrorCode.UNKNOWN_ENDPOINT: (404, "user", treadle.NotFoundError),
    ErrorCode.METHOD_NOT_ALLOWED: (405, "user", treadle.APIStatusError),
    ErrorCode.UNAUTHENTICATED: (401, "user", treadle.AuthenticationError),
    ErrorCode.PERMISSION_DENIED: (403, "user", treadle.PermissionDeniedError),
    ErrorCode.QUOTA_EXCEEDED: (403, "user", treadle.QuotaExceededError),
    ErrorCode.SPEND_LIMIT_REACHED: (402, "user", treadle.SpendLimitReachedError),
    ErrorCode.SESSION_ENDED: (410, "user", treadle.SessionExpiredError),
    ErrorCode.PAYLOAD_TOO_LARGE: (413, "user", treadle.PayloadTooLargeError),
    ErrorCode.RATE_LIMITED: (429, "user", treadle.RateLimitError),
    ErrorCode.DATABASE_NOT_MIGRATED: (503, "server", treadle.InternalServerError),
    ErrorCode.CONFIGURATION_ERROR: (500, "server", treadle.InternalServerError),
    ErrorCode.INTERNAL_ERROR: (500, "server", treadle.InternalServerError),
}

MISLEADING = "session 's' has finished: quota limit reached, checkpoint not found"


def _answer(status: int, **body: Any) -> httpx.Response:
    return httpx.Response(status, json={"detail": MISLEADING, **body})


def test_every_code_has_a_case_here_and_a_class_in_the_client() -> None:
    assert set(HTTP_CASES) == set(ErrorCode)
    assert set(sdk_errors.CLASS_BY_CODE) == set(ErrorCode)


@pytest.mark.parametrize("code", list(ErrorCode))
def test_each_code_maps_to_its_class(code: ErrorCode) -> None:
    status, category, expected = HTTP_CASES[code]
    error = error_from_response(_answer(status, category=category, code=code.value))
    assert type(error) is expected
    assert error.code == code and isinstance(error.code, ErrorCode)
    assert error.status_code == status and error.category == category
    assert error.message == MISLEADING


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        # The code decides where the status alone would say otherwise.
        (404, "session_ended", treadle.SessionExpiredError),
        (403, "quota_exceeded", treadle.QuotaExceededError),
        (403, "permission_denied", treadle.PermissionDeniedError),
        (400, "not_found", treadle.NotFoundError),
    ],
)
def test_the_code_decides_over_the_status(status: int, code: str, expected: type) -> None:
    assert type(error_from_response(_answer(status, category="user", code=code))) is expected


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (400, treadle.BadRequestError),
        (401, treadle.AuthenticationError),
        (402, treadle.SpendLimitReachedError),
        (403, treadle.PermissionDeniedError),  # whatever the message says about limits
        (404, treadle.NotFoundError),  # whatever the message says about sessions
        (405, treadle.APIStatusError),
        (410, treadle.SessionExpiredError),
        (413, treadle.PayloadTooLargeError),
        (422, treadle.BadRequestError),
        (429, treadle.RateLimitError),
        (502, treadle.InternalServerError),
        (503, treadle.InternalServerError),
    ],
)
def test_without_a_code_the_status_alone_decides(status: int, expected: type) -> None:
    error = error_from_response(_answer(status, category="user"))
    assert type(error) is expected and error.code is None
    proxy = error_from_response(httpx.Response(status, text="from the proxy"))
    assert type(proxy) is expected and proxy.code is None and proxy.body is None


def test_an_unknown_code_falls_back_on_the_status_and_is_kept() -> None:
    error = error_from_response(_answer(403, category="user", code="a_later_code"))
    assert type(error) is treadle.PermissionDeniedError
    assert error.code == "a_later_code"


# A failed operation's future: (category, code) -> the class raised.
FAILED_CASES: list[tuple[str, str | None, type[treadle.RequestFailedError]]] = [
    ("user", "not_found", treadle.RequestNotFoundError),
    ("user", "invalid_input", treadle.RequestRejectedError),
    ("user", "unsupported", treadle.RequestRejectedError),
    ("user", "quota_exceeded", treadle.RequestRejectedError),
    ("server", "internal_error", treadle.RequestFailedError),
    # An older server sends no code: the category alone decides, the message never does.
    ("user", None, treadle.RequestRejectedError),
    ("server", None, treadle.RequestFailedError),
    ("unknown", None, treadle.RequestFailedError),
    ("user", "a_code_from_a_newer_server", treadle.RequestRejectedError),
]


@pytest.mark.parametrize(("category", "code", "expected"), FAILED_CASES)
def test_failed_operations_map_on_the_code(
    category: str, code: str | None, expected: type[treadle.RequestFailedError]
) -> None:
    error = error_from_failed_request(MISLEADING, category, "req-1", code)
    assert type(error) is expected
    assert error.code == code and error.category == category and error.request_id == "req-1"
    if expected is treadle.RequestNotFoundError:
        assert isinstance(error, treadle.NotFoundError) and error.status_code == 404
    if expected is treadle.RequestRejectedError:
        assert isinstance(error, treadle.BadRequestError) and error.status_code == 422


@pytest.fixture
def server() -> FakeServer:
    return FakeServer()


@pytest.fixture
def trainer(server: FakeServer) -> Iterator[treadle.TrainingClient]:
    with treadle.ServiceClient(
        base_url="http://fake", api_key="tml-x", transport=server.transport(), retry=FAST
    ) as service:
        yield service.create_lora_training_client("tiny", rank=4)


def _fail_optim_steps(monkeypatch: pytest.MonkeyPatch, server: FakeServer, body: Any) -> None:
    submit = server._submit

    def failing(path: str, target: str, seq_id: int | None, sent: Any, result: Any) -> Any:
        if path == "/optim_step":
            result = httpx.Response(200, json=body)
        return submit(path, target, seq_id, sent, result)

    monkeypatch.setattr(server, "_submit", failing)


@pytest.mark.parametrize(("category", "code", "expected"), FAILED_CASES)
def test_a_failed_future_raises_by_its_code(
    monkeypatch: pytest.MonkeyPatch,
    server: FakeServer,
    trainer: treadle.TrainingClient,
    category: str,
    code: str | None,
    expected: type,
) -> None:
    body: dict[str, Any] = {"error": MISLEADING, "category": category}
    if code is not None:
        body["code"] = code
    _fail_optim_steps(monkeypatch, server, body)
    with pytest.raises(treadle.RequestFailedError) as raised:
        trainer.optim_step().result()
    assert type(raised.value) is expected
    assert raised.value.code == code and raised.value.message == MISLEADING


def test_the_error_module_never_reads_message_text() -> None:
    """No `.lower()`, no `in message`, no comparison against a message: classes follow codes."""
    source = Path(sdk_errors.__file__).read_text()
    assert ".lower()" not in source
    assert "in message" not in source and "in lowered" not in source
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(
            isinstance(op, ast.In | ast.NotIn) for op in node.ops
        ):
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            assert not names & {"message", "detail", "lowered", "text"}, ast.unparse(node)
