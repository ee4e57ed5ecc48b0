"""No lockouts: sessions end when their process exits, and a leftover one can be ended by hand.

Real client processes train against a real server under a small concurrent-session quota and
are stopped the way people stop them (Ctrl-C, SIGTERM, SIGKILL); the quota error, the SDK's
`RestClient` and the `treadle sessions` command are what a locked-out user has to go on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

import treadle
from tests.server import LiveServer
from treadle import cli

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MODEL = "treadle/tiny-1m"


class Worker:
    """A `tests.e2e._looping_client` process, training until it is stopped."""

    def __init__(self, server: LiveServer, api_key: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TREADLE_", "TINKER_"))}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e._looping_client", server.base_url, api_key],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.session_id = ""

    def wait_ready(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.startswith("ready "):
            self.process.kill()
            _, err = self.process.communicate(timeout=30)
            pytest.fail(f"worker did not start: {line!r}\n{err}")
        self.session_id = line.split()[1]
        return self.session_id

    def stop(self, signum: int) -> int:
        self.process.send_signal(signum)
        return self.process.wait(timeout=60)


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        if worker.process.poll() is None:
            worker.process.kill()
            worker.process.wait(timeout=30)


def _open_ids(server: LiveServer, api_key: str) -> set[str]:
    with treadle.RestClient(base_url=server.base_url, api_key=api_key) as rest:
        return {info.session_id for info in rest.list_open_sessions().result()}


def test_sessions_of_interrupted_processes_end_at_exit(
    live_server: LiveServer, workers: list[Worker]
) -> None:
    tenant = live_server.make_tenant(max_concurrent_sessions=4)
    workers.extend(Worker(live_server, tenant.key) for _ in range(4))
    ids = {worker.wait_ready() for worker in workers}
    assert _open_ids(live_server, tenant.key) == ids

    for worker in workers:
        worker.process.send_signal(signal.SIGINT)
    for worker in workers:
        worker.process.wait(timeout=60)
        assert worker.process.stderr is not None
        assert "KeyboardInterrupt" in worker.process.stderr.read()  # not swallowed

    # At once, with no idle expiry: the four slots were given back when the processes exited.
    with treadle.ServiceClient(base_url=live_server.base_url, api_key=tenant.key) as service:
        service.create_lora_training_client(MODEL, rank=4)
        assert _open_ids(live_server, tenant.key) == {service.session_id}
    with treadle.RestClient(base_url=live_server.base_url, api_key=tenant.key) as rest:
        ended = [rest.get_session(sid).result() for sid in ids]
    assert {(info.status, info.end_reason) for info in ended} == {("finished", "interrupted")}


def test_a_sigterm_ends_the_session_and_still_terminates(
    live_server: LiveServer, workers: list[Worker]
) -> None:
    tenant = live_server.make_tenant(max_concurrent_sessions=1)
    workers.append(Worker(live_server, tenant.key))
    workers[0].wait_ready()
    assert workers[0].stop(signal.SIGTERM) == -signal.SIGTERM
    assert _open_ids(live_server, tenant.key) == set()


def test_a_killed_process_s_session_is_named_by_the_quota_error_and_ended_with_the_cli(
    live_server: LiveServer, workers: list[Worker], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "console", Console(width=400, emoji=False, highlight=False))
    tenant = live_server.make_tenant(max_concurrent_sessions=1)
    workers.append(Worker(live_server, tenant.key))
    left_over = workers[0].wait_ready()
    workers[0].stop(signal.SIGKILL)  # no exit handling can run

    with (
        treadle.ServiceClient(base_url=live_server.base_url, api_key=tenant.key) as service,
        pytest.raises(treadle.QuotaExceededError) as refused,
    ):
        service.create_lora_training_client(MODEL, rank=4)
    message = refused.value.message
    assert left_over in message
    assert "last heartbeat" in message and "opened" in message
    assert "treadle sessions end ID" in message

    runner = CliRunner()
    options = ["--base-url", live_server.base_url, "--api-key", tenant.key]
    listed = runner.invoke(cli.app, ["sessions", *options])
    assert listed.exit_code == 0, listed.output
    assert left_over in listed.output
    as_json = runner.invoke(cli.app, ["sessions", "--json", *options])
    assert [s["session_id"] for s in json.loads(as_json.output)["sessions"]] == [left_over]

    ended = runner.invoke(cli.app, ["sessions", "end", left_over, *options])
    assert ended.exit_code == 0, ended.output
    assert left_over in ended.output and "finished" in ended.output
    assert _open_ids(live_server, tenant.key) == set()

    with treadle.ServiceClient(base_url=live_server.base_url, api_key=tenant.key) as service:
        service.create_lora_training_client(MODEL, rank=4)

    unknown = runner.invoke(cli.app, ["sessions", "end", "no-such-session", *options])
    assert unknown.exit_code == 1
    assert "not found" in unknown.output


def test_the_quota_error_stays_short_with_many_open_sessions(live_server: LiveServer) -> None:
    tenant = live_server.make_tenant(max_concurrent_sessions=8)
    services = [
        treadle.ServiceClient(base_url=live_server.base_url, api_key=tenant.key) for _ in range(8)
    ]
    try:
        for service in services:
            service.create_sampling_client(base_model=MODEL)
        with (
            treadle.ServiceClient(base_url=live_server.base_url, api_key=tenant.key) as extra,
            pytest.raises(treadle.QuotaExceededError) as refused,
        ):
            extra.create_sampling_client(base_model=MODEL)
        message = refused.value.message
        named = [s.session_id for s in services if s.session_id and s.session_id in message]
        assert len(named) == 5
        assert "and 3 more" in message and "treadle sessions" in message
        assert len(message) < 1200
    finally:
        for service in services:
            service.close()
