"""An unreachable server fails fast and says where; a server that was reached gets patience.

Nothing listens on the port these tests use, so the connection is refused at once: what is
measured is the SDK's first-contact deadline, not the network.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import treadle
from tests.services import free_port
from treadle import types
from treadle._http import RetryPolicy

TREADLE_CLI = str(Path(sys.executable).with_name("treadle"))
KEY = "tml-000000000000-" + "x" * 32
PATIENT = RetryPolicy(max_elapsed_seconds=300.0, initial_backoff_seconds=0.05)


def _closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def test_the_sdk_gives_up_on_an_unreachable_url_within_seconds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = _closed_url()
    started = time.monotonic()
    with (
        treadle.ServiceClient(base_url=url, api_key=KEY, retry=PATIENT) as service,
        pytest.raises(treadle.APIConnectionError) as raised,
        caplog.at_level(logging.INFO),
    ):
        service.create_lora_training_client("treadle/tiny-1m", rank=4)
    assert time.monotonic() - started <= 15
    assert url in str(raised.value) and "base_url=" in str(raised.value)
    assert "TREADLE_CONNECT_TIMEOUT" in str(raised.value)
    retries = [r for r in caplog.records if "retry" in r.getMessage()]
    assert retries and retries[0].levelno == logging.INFO
    assert any(r.levelno == logging.WARNING and url in r.getMessage() for r in retries)


@pytest.mark.parametrize("variable", ["TREADLE_BASE_URL", "TINKER_BASE_URL"])
def test_the_error_names_the_variable_that_set_the_url(
    variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = _closed_url()
    monkeypatch.delenv("TREADLE_BASE_URL", raising=False)
    monkeypatch.setenv(variable, url)
    monkeypatch.setenv("TREADLE_CONNECT_TIMEOUT", "1")
    with (
        treadle.RestClient(api_key=KEY) as rest,
        pytest.raises(treadle.APIConnectionError) as raised,
    ):
        rest.list_training_runs().result()
    assert f"{url} (set by {variable})" in str(raised.value)


def test_a_malformed_connect_timeout_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_CONNECT_TIMEOUT", "ten")
    with pytest.raises(ValueError, match="TREADLE_CONNECT_TIMEOUT"):
        treadle.ServiceClient(base_url=_closed_url(), api_key=KEY)


def test_after_first_contact_outages_are_retried_patiently() -> None:
    """A server that answered once and then goes away for longer than the first-contact
    deadline (a restart during a long run) is waited for."""
    down_until: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if down_until and time.monotonic() < down_until[0]:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"supported_models": []})

    with treadle.ServiceClient(
        base_url="http://treadle.invalid",
        api_key=KEY,
        retry=PATIENT,
        connect_timeout=0.2,
        transport=httpx.MockTransport(handler),
    ) as service:
        assert service.get_server_capabilities() == types.ServerCapabilities(supported_models=[])
        down_until.append(time.monotonic() + 1.0)  # five times the first-contact deadline
        assert service.get_server_capabilities().supported_models == []
        assert time.monotonic() >= down_until[0]


def _cli(*args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TREADLE_", "TINKER_"))}
    started = time.monotonic()
    done = subprocess.run(
        [TREADLE_CLI, *args],
        env={**clean, "TREADLE_API_KEY": KEY, "COLUMNS": "200", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done, time.monotonic() - started


def test_the_cli_fails_in_seconds_naming_the_url() -> None:
    url = _closed_url()
    done, elapsed = _cli("runs", "--base-url", url)
    assert elapsed <= 15, elapsed
    assert done.returncode == 1
    assert url in done.stderr and "--base-url" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_the_cli_names_the_variable_that_set_the_url() -> None:
    url = _closed_url()
    done, _ = _cli("sessions", TREADLE_BASE_URL=url, TREADLE_CONNECT_TIMEOUT="1")
    assert done.returncode == 1
    assert f"{url} (set by TREADLE_BASE_URL)" in " ".join(done.stderr.split()), done.stderr
