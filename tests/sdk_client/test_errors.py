"""HTTP error responses become exceptions that say what happened, with the server's message."""

from __future__ import annotations

import httpx
import pytest

import treadle
from treadle.errors import error_from_response

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("status", "code", "detail", "expected"),
    [
        (401, "unauthenticated", "invalid API key", treadle.AuthenticationError),
        (
            403,
            "quota_exceeded",
            "concurrent session limit reached: tenant 'a' allows 1",
            treadle.QuotaExceededError,
        ),
        (
            403,
            "permission_denied",
            "this key may not use the admin API",
            treadle.PermissionDeniedError,
        ),
        (402, None, "spend cap reached", treadle.SpendLimitReachedError),
        (404, "not_found", "training run 'x' not found", treadle.NotFoundError),
        (
            404,
            "session_ended",
            "session 's' has finished; start a new session (a new ServiceClient)",
            treadle.SessionExpiredError,
        ),
        (
            410,
            "session_ended",
            "session 's' expired after missing heartbeats",
            treadle.SessionExpiredError,
        ),
        (
            413,
            "payload_too_large",
            "body too large; send smaller batches",
            treadle.PayloadTooLargeError,
        ),
        (422, "invalid_input", "lora rank 512 exceeds 64; pass rank ≤ 64", treadle.BadRequestError),
        (429, "rate_limited", "slow down", treadle.RateLimitError),
        (503, "database_not_migrated", "maintenance", treadle.InternalServerError),
    ],
)
def test_status_maps_to_a_class_with_the_message(
    status: int, code: str | None, detail: str, expected: type
) -> None:
    body = {"detail": detail, "category": "user", "code": code}
    error = error_from_response(httpx.Response(status, json=body))
    assert type(error) is expected
    assert error.message == detail and error.status_code == status and error.category == "user"
    assert error.code == code
    assert detail in str(error)


def test_non_json_bodies_keep_their_text() -> None:
    error = error_from_response(httpx.Response(502, text="Bad Gateway from the proxy"))
    assert isinstance(error, treadle.InternalServerError)
    assert error.message == "Bad Gateway from the proxy" and error.body is None


def test_session_expired_is_a_not_found_error() -> None:
    assert issubclass(treadle.SessionExpiredError, treadle.NotFoundError)
    assert issubclass(treadle.QuotaExceededError, treadle.PermissionDeniedError)


def test_request_failed_error_carries_the_category() -> None:
    error = treadle.RequestFailedError(
        "unknown loss 'foo'; use cross_entropy", category="user", request_id="r1"
    )
    assert error.category == "user" and "cross_entropy" in str(error)


def test_missing_api_key_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TREADLE_API_KEY", raising=False)
    with pytest.raises(treadle.AuthenticationError, match="TREADLE_API_KEY"):
        treadle.ServiceClient(base_url="http://fake")


def test_environment_provides_url_and_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from treadle.client.service import resolve_credentials

    monkeypatch.setenv("TREADLE_BASE_URL", "http://server:9000/")
    monkeypatch.setenv("TREADLE_API_KEY", "tml-abc-def")
    assert resolve_credentials(None, None) == ("http://server:9000", "tml-abc-def")
    assert resolve_credentials("http://other", "tml-k") == ("http://other", "tml-k")
