"""An acknowledged request survives a crash of the server, and runs exactly once after restart.

The API answers a training request only once the request is committed to the op log. Here a
real `treadle-server serve` process is killed with SIGKILL right after it answered the last of a
burst of requests (some may have run, one may be running, the rest are queued). A new process on
the same data directory must finish every one of them, once: the run ends with the same weights
as an identical run that was never interrupted, and each request is billed once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from billing.tables import UsageEvent
from core.db import Database
from tests.embedded_app import datum
from tests.services import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "treadle/tiny-1m"
TOKENS = [(7 * i) % 250 + 12 for i in range(17)]
_KEY = re.compile(r"tml-[0-9a-f]{12}-[A-Za-z0-9_-]{32,}")


@contextmanager
def serve(data_dir: Path, port: int) -> Iterator[subprocess.Popen[str]]:
    """`treadle-server serve` as a user runs it; yields once it listens."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TREADLE_", "TINKER_"))}
    env.update(TREADLE_DATA_DIR=str(data_dir), TREADLE_MODELS=json.dumps([MODEL]), COLUMNS="200")
    cli = str(Path(sys.executable).with_name("treadle-server"))
    process = subprocess.Popen(
        [cli, "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    output, deadline = "", time.monotonic() + 120
    try:
        while "Uvicorn running on" not in output:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{output}")
            output += process.stdout.readline()
        process.banner = output  # type: ignore[attr-defined]
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
        process.wait(timeout=60)


def _submit(http: httpx.Client, route: str, body: dict[str, Any]) -> str:
    response = http.post(f"/{route}", json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["request_id"])


def _result(http: httpx.Client, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        body: dict[str, Any] = http.post("/retrieve_future", json={"request_id": request_id}).json()
        if body.get("type") != "try_again":
            assert "error" not in body, body
            return body
    raise AssertionError(f"request {request_id} did not finish")


def _create(http: httpx.Client, session_id: str, model_seq_id: int) -> str:
    body = {
        "session_id": session_id,
        "model_seq_id": model_seq_id,
        "base_model": MODEL,
        "lora_config": {"rank": 4, "seed": 5},
    }
    return str(_result(http, _submit(http, "create_model", body))["model_id"])


def _burst(http: httpx.Client, run_id: str) -> list[str]:
    """Two forward_backward requests and an optimizer step, submitted without waiting."""
    fb = {"data": [datum(TOKENS)], "loss_fn": "cross_entropy"}
    return [
        _submit(http, "forward_backward", {"model_id": run_id, "seq_id": 1, **fb}),
        _submit(http, "forward_backward", {"model_id": run_id, "seq_id": 2, **fb}),
        _submit(
            http,
            "optim_step",
            {"model_id": run_id, "seq_id": 3, "adam_params": {"learning_rate": 0.05}},
        ),
    ]


def _loss_after(http: httpx.Client, run_id: str) -> float:
    body = {
        "model_id": run_id,
        "seq_id": 4,
        "data": [datum(TOKENS)],
        "loss_fn": "cross_entropy",
        "forward_only": True,
    }
    return float(_result(http, _submit(http, "forward_backward", body))["metrics"]["loss:sum"])


def test_requests_acknowledged_before_a_sigkill_run_once_after_restart(tmp_path: Path) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}/api/v1"
    with serve(tmp_path, port) as server:
        match = _KEY.search(server.banner)  # type: ignore[attr-defined]
        assert match, server.banner
        http = httpx.Client(base_url=base_url, headers={"X-API-Key": match.group(0)}, timeout=60)
        session_id = http.post("/create_session", json={}).json()["session_id"]
        # The same work, never interrupted: what the crashed run must end as.
        reference = _create(http, session_id, 0)
        for request_id in _burst(http, reference):
            _result(http, request_id)
        expected = _loss_after(http, reference)

        crashed = _create(http, session_id, 1)
        acknowledged = _burst(http, crashed)
        server.send_signal(signal.SIGKILL)  # right after the last answer
        server.wait(timeout=30)

    with serve(tmp_path, port):
        for request_id in acknowledged:
            _result(http, request_id)
        assert _loss_after(http, crashed) == pytest.approx(expected, rel=1e-6)
    http.close()

    database = Database(f"sqlite:///{tmp_path / 'treadle.db'}")
    try:
        with database.reader() as db:
            billed = dict(
                db.execute(
                    select(UsageEvent.operation_id, func.count())
                    .where(UsageEvent.operation_id.in_(acknowledged[:2]))
                    .group_by(UsageEvent.operation_id)
                ).all()
            )
    finally:
        database.dispose()
    assert billed == {request_id: 1 for request_id in acknowledged[:2]}
