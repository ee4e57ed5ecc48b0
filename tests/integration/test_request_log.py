"""The access line of each request and the worker's line of each op, as an embedded app writes
them: their fields in JSON, their text shape, the X-Request-Id a client sends or gets, the op id
that joins the two lines, and never any part of an API key."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import Iterator
from typing import Any
from unittest.mock import patch

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.errors import install_error_handlers
from api.request_log import RequestLog
from core import logs
from tests.builders import TenantFactory, TenantKey, tenant_factory
from tests.embedded_app import MODEL, EmbeddedApp, datum, embedded_app
from tests.server import AppFactory

pytestmark = pytest.mark.integration

LOGGERS = ("treadle.access", "treadle.ops")
TOKENS = [(5 * i) % 200 + 10 for i in range(9)]
GENERATED_ID = re.compile(r"[0-9a-f]{32}")
TEXT_TIME = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


class Lines(logging.Handler):
    """Keeps the records of the access and op loggers."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def json(self, logger: str) -> list[dict[str, Any]]:
        formatter = logs.JsonFormatter()
        return [json.loads(formatter.format(r)) for r in self.records if r.name == logger]

    def access(self, request_id: str) -> dict[str, Any]:
        (line,) = [line for line in self.json("treadle.access") if line["request_id"] == request_id]
        return line

    def op(self, op_id: str) -> dict[str, Any]:
        """The op's line; it is written just after the record commits, which a poll may see
        first."""
        for _ in range(500):
            found = [line for line in self.json("treadle.ops") if line["op_id"] == op_id]
            if found:
                (line,) = found
                return line
            time.sleep(0.01)
        raise AssertionError(f"no op line for {op_id}")

    def text(self) -> list[str]:
        formatter = logs.TextFormatter()
        return [formatter.format(r) for r in self.records]


@contextlib.contextmanager
def captured() -> Iterator[Lines]:
    lines = Lines()
    saved = [(logging.getLogger(name), logging.getLogger(name).level) for name in LOGGERS]
    for logger, _ in saved:
        logger.addHandler(lines)
        logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        for logger, level in saved:
            logger.removeHandler(lines)
            logger.setLevel(level)


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedApp]:
    with embedded_app(tmp_path_factory.mktemp("request_log")) as app:
        yield app


@pytest.fixture(scope="module")
def tenants(app: EmbeddedApp) -> TenantFactory:
    return tenant_factory(app.database, app.settings)


@pytest.fixture
def tenant(tenants: TenantFactory) -> TenantKey:
    return tenants()


def _create_run(app: EmbeddedApp, tenant: TenantKey, request_id: str) -> tuple[Any, str]:
    """The create_model answer (sent with `request_id`) and the run's id once created."""
    headers = {"X-API-Key": tenant.key}
    session_id = app.session(headers)
    body = {"session_id": session_id, "model_seq_id": 0, "base_model": MODEL}
    response = app.post({**headers, "X-Request-Id": request_id}, "create_model", body)
    assert response.status_code == 200, response.text
    created = app.result(headers, response.json()["request_id"])
    return response, str(created["model_id"])


def test_a_submission_logs_its_tenant_op_and_run_and_the_op_line_joins_it(
    app: EmbeddedApp, tenant: TenantKey
) -> None:
    with captured() as lines:
        response, run_id = _create_run(app, tenant, "client.req-1:a_b")
        op_id = response.json()["request_id"]
        access = lines.access("client.req-1:a_b")
        op = lines.op(op_id)
    assert response.headers["X-Request-Id"] == "client.req-1:a_b"
    assert access.keys() == {
        *("ts", "level", "logger", "msg", "request_id", "method", "route", "status"),
        *("duration_ms", "client", "tenant_id", "op_id", "target_id"),
    }
    assert access["level"] == "INFO"
    assert access["client"] == "testclient"  # the peer's host as the server got it, no port
    assert (access["method"], access["route"], access["status"]) == (
        "POST",
        "/api/v1/create_model",
        200,
    )
    assert isinstance(access["duration_ms"], float) and access["duration_ms"] >= 0
    assert (access["tenant_id"], access["op_id"], access["target_id"]) == (
        tenant.tenant_id,
        op_id,
        run_id,
    )
    assert op.keys() == {
        *("ts", "level", "logger", "msg", "op_id", "op_kind", "target_id", "tenant_id"),
        *("outcome", "queue_wait_ms", "execution_ms", "end_to_end_ms", "worker_id"),
    }
    assert (op["op_kind"], op["target_id"], op["tenant_id"], op["outcome"]) == (
        "create_model",
        run_id,
        tenant.tenant_id,
        "done",
    )
    assert op["worker_id"] == "embedded"
    for name in ("queue_wait_ms", "execution_ms", "end_to_end_ms"):
        assert isinstance(op[name], float) and op[name] >= 0, op
    assert op["end_to_end_ms"] >= op["execution_ms"]


def test_a_failed_op_logs_its_error_code(app: EmbeddedApp, tenant: TenantKey) -> None:
    headers = {"X-API-Key": tenant.key}
    _, run_id = _create_run(app, tenant, "failing-run")
    bad = datum(TOKENS)
    bad["loss_fn_inputs"]["weights"] = {"data": [1.0] * len(TOKENS), "dtype": "float32"}
    body = {"model_id": run_id, "seq_id": 1, "data": [bad], "loss_fn": "cross_entropy"}
    with captured() as lines:
        op_id = app.submit(headers, "forward_backward", body)
        failed = app.result(headers, op_id)
        op = lines.op(op_id)
    assert failed["category"] == "user", failed
    assert (op["op_kind"], op["outcome"]) == ("forward_backward", "failed")
    assert (op["error_code"], op["error_category"]) == ("invalid_input", "user")


def test_lines_name_the_route_template_not_the_ids_in_the_url(
    app: EmbeddedApp, tenant: TenantKey
) -> None:
    _, run_id = _create_run(app, tenant, "templated-run")
    with captured() as lines:
        response = app.client.get(
            f"/api/v1/training_runs/{run_id}",
            headers={"X-API-Key": tenant.key, "X-Request-Id": "get-run"},
        )
    assert response.status_code == 200, response.text
    line = lines.access("get-run")
    assert line["route"] == "/api/v1/training_runs/{run_id}"
    assert run_id not in line["msg"] and "target_id" not in line and "op_id" not in line


@pytest.mark.parametrize("sent", [None, "", "has space", "a" * 129, "semi;colon", "a/b"])
def test_a_missing_or_unsafe_request_id_is_replaced(app: EmbeddedApp, sent: str | None) -> None:
    headers = {} if sent is None else {"X-Request-Id": sent}
    with captured() as lines:
        response = app.client.get("/api/v1/healthz", headers=headers)
    given = response.headers["X-Request-Id"]
    assert GENERATED_ID.fullmatch(given), given
    assert lines.access(given)["route"] == "/api/v1/healthz"


def test_the_longest_safe_request_id_is_kept(app: EmbeddedApp) -> None:
    sent = "A-z.0:9_" * 16
    response = app.client.get("/api/v1/healthz", headers={"X-Request-Id": sent})
    assert response.headers["X-Request-Id"] == sent


def test_errors_carry_the_request_id_and_no_tenant_without_a_key(app: EmbeddedApp) -> None:
    with captured() as lines:
        refused = app.post({"X-Request-Id": "no-key"}, "create_session", {})
        unmatched = app.client.get("/api/v1/no/such/route", headers={"X-Request-Id": "nowhere"})
    assert (refused.status_code, refused.headers["X-Request-Id"]) == (401, "no-key")
    assert (unmatched.status_code, unmatched.headers["X-Request-Id"]) == (404, "nowhere")
    assert lines.access("no-key")["status"] == 401
    assert "tenant_id" not in lines.access("no-key")
    assert lines.access("nowhere")["route"] == "<unmatched>"


def test_an_unexpected_fault_answers_500_with_the_request_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Starlette answers such a fault outside every middleware: its handler adds the id."""
    bare = FastAPI()
    install_error_handlers(bare)
    bare.add_middleware(RequestLog)

    @bare.get("/boom/{n}")
    def _boom(n: int) -> None:
        raise RuntimeError("a bug")

    with (
        captured() as lines,
        caplog.at_level(logging.ERROR, logger="api.errors"),
        TestClient(bare, raise_server_exceptions=False) as client,
    ):
        response = client.get("/boom/7", headers={"X-Request-Id": "fault-1"})
    assert (response.status_code, response.headers["X-Request-Id"]) == (500, "fault-1")
    (fault,) = [r for r in caplog.records if r.name == "api.errors"]
    assert fault.getMessage() == "unhandled error in request fault-1" and fault.exc_info
    assert fault.__dict__["request_id"] == "fault-1"
    line = lines.access("fault-1")
    assert (line["status"], line["route"]) == (500, "/boom/{n}")


def test_the_real_apps_500_carries_the_request_id(
    app_factory: AppFactory, sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The same through every middleware the app installs, in the order it installs them."""
    real = app_factory(sqlite_url)

    @real.get("/api/v1/boom")
    def _boom() -> None:
        raise RuntimeError("a bug")

    with (
        captured() as lines,
        caplog.at_level(logging.ERROR, logger="api.errors"),
        TestClient(real, raise_server_exceptions=False) as client,
    ):
        response = client.get("/api/v1/boom", headers={"X-Request-Id": "real-fault"})
    assert (response.status_code, response.headers["X-Request-Id"]) == (500, "real-fault")
    assert [r.getMessage() for r in caplog.records if r.name == "api.errors"] == [
        "unhandled error in request real-fault"
    ]
    assert lines.access("real-fault")["status"] == 500


def test_no_line_is_built_while_info_is_off(app: EmbeddedApp) -> None:
    access = logging.getLogger("treadle.access")
    saved = access.level
    access.setLevel(logging.WARNING)
    try:
        with patch("api.request_log._fields", side_effect=AssertionError("built")):
            response = app.client.get("/api/v1/healthz")
    finally:
        access.setLevel(saved)
    assert response.status_code == 200


def test_no_line_holds_any_part_of_the_key(app: EmbeddedApp, tenant: TenantKey) -> None:
    with captured() as lines:
        _create_run(app, tenant, "keyless")
        app.post({"X-API-Key": tenant.key + "x"}, "create_session", {})  # a wrong secret
    written = "\n".join(lines.text() + [json.dumps(line) for line in lines.json("treadle.access")])
    secret = tenant.key.split("-", 2)[2]  # tml-<key id>-<secret>; the secret may hold "-"
    for part in (tenant.key, secret, f"tml-{tenant.key_id}", tenant.key_id):
        assert part not in written


def test_text_lines_read_like_an_access_log(app: EmbeddedApp, tenant: TenantKey) -> None:
    with captured() as lines:
        response, run_id = _create_run(app, tenant, "text-line")
        op_id = response.json()["request_id"]
        lines.op(op_id)
    text = lines.text()
    access = rf"{TEXT_TIME} INFO treadle\.access POST /api/v1/create_model 200 \d+\.\d ms "
    access += rf"rid=text-line client=testclient tenant={tenant.tenant_id} op={op_id} "
    access += rf"target={run_id}"
    assert [line for line in text if re.fullmatch(access, line)], text
    op = rf"{TEXT_TIME} INFO treadle\.ops op {op_id} create_model on {run_id} done in \d+\.\d ms "
    op += rf"\(queued \d+\.\d ms, \d+\.\d ms end to end\) tenant={tenant.tenant_id} worker=embedded"
    assert [line for line in text if re.fullmatch(op, line)], text
