"""The metrics without a server: what is counted of a recorded op and of a refusal, the fleet
gauges when the database does not answer, the metrics port a worker serves (bound before it
registers), and the settings."""

from __future__ import annotations

import asyncio
import logging
import socket
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from starlette.types import Message, Receive, Scope, Send

from api import metrics as api_metrics
from billing.ledger import UsageLine
from core.clock import FakeClock
from core.db import Database
from core.errors import ConfigurationError
from core.settings import Settings
from core.tables import Operation, OpStatus
from scheduler import metrics
from scheduler.fleet_gauges import FleetGauges
from scheduler.worker import host, process
from tests.services import free_port

pytestmark = pytest.mark.unit

CREATED = datetime(2026, 1, 1, 12, 0, 0)


def _op(status: OpStatus, category: str | None = None, started: float | None = 2.0) -> Operation:
    return Operation(
        kind="forward_backward",
        status=status.value,
        error_category=category,
        created_at=CREATED,
        started_at=None if started is None else CREATED + timedelta(seconds=started),
        finished_at=CREATED + timedelta(seconds=5),
    )


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_done_op_counts_its_token_kinds_only() -> None:
    usage = [
        UsageLine("training", 40),
        UsageLine("checkpoint", 1),
        UsageLine("sampling_prefill", 0),
    ]
    recorded = metrics.RecordedOp.of(_op(OpStatus.DONE), usage)
    assert recorded.failed_category is None
    assert recorded.tokens == (("training", 40),)
    before = _value("treadle_tokens_total", kind="training")
    waits = _value("treadle_op_queue_wait_seconds_sum", kind="forward_backward")
    metrics.observe_recorded(recorded)
    assert _value("treadle_tokens_total", kind="training") == before + 40
    assert _value("treadle_op_queue_wait_seconds_sum", kind="forward_backward") == waits + 2


def test_a_failure_without_a_category_counts_as_the_servers() -> None:
    assert metrics.RecordedOp.of(_op(OpStatus.FAILED), []).failed_category == "server"
    user = metrics.RecordedOp.of(_op(OpStatus.FAILED, "user"), [])
    before = _value(
        "treadle_ops_finished_total", kind="forward_backward", outcome="failed", category="user"
    )
    metrics.observe_recorded(user)
    after = _value(
        "treadle_ops_finished_total", kind="forward_backward", outcome="failed", category="user"
    )
    assert after == before + 1


def test_clock_skew_never_makes_a_negative_duration() -> None:
    # Started "before" it was submitted: the API's clock ran ahead of the worker's.
    skewed = metrics.RecordedOp.of(_op(OpStatus.DONE, started=-3.0), [])
    waits = _value("treadle_op_queue_wait_seconds_sum", kind="forward_backward")
    immediate = _value("treadle_op_queue_wait_seconds_bucket", kind="forward_backward", le="0.005")
    metrics.observe_recorded(skewed)
    assert _value("treadle_op_queue_wait_seconds_sum", kind="forward_backward") == waits
    assert (
        _value("treadle_op_queue_wait_seconds_bucket", kind="forward_backward", le="0.005")
        == immediate + 1
    )


def test_fleet_gauges_report_a_database_that_does_not_answer() -> None:
    database = Database(f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/none")
    families = list(FleetGauges(database, FakeClock()).collect())
    assert [(f.name, [s.value for s in f.samples]) for f in families] == [("treadle_fleet_up", [0])]


def test_a_worker_serves_its_metrics_on_the_metrics_port() -> None:
    assert metrics.serve_port(Settings(metrics_port=None)) is None
    port = free_port()
    server = metrics.serve_port(Settings(metrics_port=port))
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        metrics.stop_port(server)
    names = {family.name for family in text_string_to_metric_families(text)}
    assert {"treadle_ops_finished", "treadle_tokens", "treadle_op_queue_wait_seconds"} <= names
    # Beat's failover count and the fleet's gauges are beat's alone.
    assert "treadle_worker_failovers" not in names and "treadle_fleet_up" not in names
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_a_port_in_use_is_a_configuration_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigurationError, match="set TREADLE_METRICS_PORT to a free port"):
            metrics.serve_port(Settings(metrics_port=port))


def test_metrics_token_settings() -> None:
    assert Settings(metrics_token="").metrics_token is None
    assert Settings(metrics_token="  ").metrics_token is None
    with pytest.raises(ValidationError, match="TREADLE_METRICS_TOKEN is too short"):
        Settings(metrics_token="short")
    assert Settings().metrics_host == "127.0.0.1" and Settings().metrics_port is None


def test_fleet_gauges_log_an_outage_once(caplog: pytest.LogCaptureFixture) -> None:
    gauges = FleetGauges(
        Database(f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/none"), FakeClock()
    )
    with caplog.at_level(logging.DEBUG, logger="scheduler.fleet_gauges"):
        for _ in range(3):
            list(gauges.collect())
    gauges.close()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "reading the fleet gauges failed" in warnings[0].getMessage()


async def _refuse(status: int, body: bytes, send: Send) -> None:
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": body})


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"detail": "slow down", "code": "rate_limited"}', "rate_limited"),
        # Under /oai/ the error is OpenAI's shape (`api.errors.for_path`).
        (b'{"error": {"message": "slow down", "code": "queue_full"}}', "queue_full"),
        (b"not json", "unknown"),
        (b"[1]", "unknown"),
    ],
)
def test_a_refusal_is_counted_by_the_code_of_either_error_shape(body: bytes, reason: str) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await _refuse(429, body, send)

    async def receive() -> Message:
        return {"type": "http.request", "body": b""}

    async def send(message: Message) -> None:
        pass

    labels = {"status": "429", "reason": reason, "route": api_metrics.UNMATCHED}
    before = _value("treadle_http_refusals_total", **labels)
    scope = {"type": "http", "method": "POST", "path": "/oai/v1/completions"}
    asyncio.run(api_metrics.RequestMetrics(app)(scope, receive, send))
    assert _value("treadle_http_refusals_total", **labels) == before + 1


def test_request_latency_is_bucketed_up_to_ten_minutes() -> None:
    before = _value(
        "treadle_http_request_duration_seconds_bucket",
        route="/x",
        method="GET",
        status_class="2xx",
        le="600.0",
    )
    api_metrics.REQUEST_SECONDS.labels("/x", "GET", "2xx").observe(400)
    try:
        assert (
            _value(
                "treadle_http_request_duration_seconds_bucket",
                route="/x",
                method="GET",
                status_class="2xx",
                le="600.0",
            )
            == before + 1
        )
    finally:
        # The registry is the process's: a made-up route must not outlive this test.
        api_metrics.REQUEST_SECONDS.remove("/x", "GET", "2xx")


def test_a_worker_binds_its_metrics_port_before_it_registers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def start_host(*_: object, **__: object) -> None:
        raise AssertionError("the worker registered before its metrics port was bound")

    monkeypatch.setattr(host, "start_host", start_host)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = Settings(
            metrics_port=taken.getsockname()[1],
            liveness_file=tmp_path / "alive",
            redis_url="redis://127.0.0.1:1/0",
        )
        with pytest.raises(ConfigurationError, match="set TREADLE_METRICS_PORT to a free port"):
            process.run_worker(settings, worker_id="w-1", models=["treadle/tiny-1m"])
