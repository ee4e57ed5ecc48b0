"""HTTP error responses become exceptions that say what happened, with the server's message."""

from __future__ import annotations

import httpx
import pytest

import treadle
from treadle.errors import error_from_response

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("status", "detail", "expected"),
    [
        (401, "invalid API key", treadle.AuthenticationError),
        (403, "concurrent session limit reached: tenant 'a' allows 1", treadle.QuotaExceededError),
        (403, "this key may not use the admin API", treadle.PermissionDeniedError),
        (402, "spend cap reached", treadle.QuotaExceededError),
        (404, "training run 'x' not found", treadle.NotFoundError),
        (
            404,
            "session 's' has finished; start a new session (a new ServiceClient)",
            treadle.SessionExpiredError,
        ),
        (410, "session 's' expired after missing heartbeats", treadle.SessionExpiredError),
        (413, "body too large; send smaller batches", treadle.PayloadTooLargeError),
        (422, "lora rank 512 exceeds 64; pass rank ≤ 64", treadle.BadRequestError),
        (429, "slow down", treadle.RateLimitError),
        (503, "maintenance", treadle.InternalServerError),
    ],
)
def test_status_maps_to_a_class_with_the_message(status: int, detail: str, expected: type) -> None:
    error = error_from_response(httpx.Response(status, json={"detail": detail, "category": "user"}))
    assert type(error) is expected
    assert error.message == detail and error.status_code == status and error.category == "user"
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
