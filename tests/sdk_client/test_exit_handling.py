"""Sessions end when the process ends without `close()`, within a few seconds at most.

Each case runs `tests.sdk_client._exit_worker` in a real process against fake servers and reads
back the finish requests they received.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _run(mode: str, clients: int = 1) -> tuple[subprocess.CompletedProcess[str], list[Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.sdk_client._exit_worker", mode, str(clients)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("finish: ")]
    assert lines, done.stdout + done.stderr
    return done, json.loads(lines[-1].removeprefix("finish: "))


def test_a_normal_exit_finishes_the_session() -> None:
    done, finishes = _run("exit")
    assert done.returncode == 0, done.stderr
    assert finishes == [
        {
            "session": "s1",
            "reason": "success",
            "detail": "the process exited without ServiceClient.close()",
        }
    ]


def test_an_uncaught_exception_finishes_the_session_as_errored() -> None:
    done, finishes = _run("raise")
    assert done.returncode == 1
    assert "RuntimeError: the training script failed" in done.stderr
    assert [(f["reason"], "the training script failed" in f["detail"]) for f in finishes] == [
        ("errored", True)
    ]


def test_the_program_s_own_sigterm_handler_runs_and_the_session_ends_when_it_exits() -> None:
    done, finishes = _run("own-sigterm")
    assert done.returncode == 3, done.stderr
    assert "handled" in done.stdout
    assert [(f["reason"], f["detail"]) for f in finishes] == [
        ("interrupted", "the process exited after receiving SIGTERM")
    ]


def test_an_unreachable_server_delays_the_exit_by_seconds_not_minutes() -> None:
    started = time.monotonic()
    done, finishes = _run("unreachable", clients=4)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert finishes == []
    assert done.stderr.count("could not finish session s1 at exit") == 4
    assert elapsed < 15, elapsed  # four sessions of five seconds each, finished side by side
