"""Prometheus metrics, scraped for real: `/metrics` behind its token, the counts an SFT and
sampling loop leaves equal to the op log's and the ledger's rows, the metrics port of the API
and of beat (the fleet's gauges and failovers), and the Grafana dashboard's queries naming only
metrics that exist."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

import treadle
from billing.tables import UsageEvent
from core.tables import Operation, OpStatus, TrainingRun
from scheduler import fleet
from scheduler.beat import run_beat
from scheduler.fleet_gauges import FleetGauges
from scheduler.metrics import TOKEN_KINDS
from tests.builders import make_settings, tenant_factory
from tests.e2e.treadle_data import MODEL, sft_datum
from tests.scheduling import Rows, migrated
from tests.scrape import Samples, by, delta, eventually, parse, reachable, scrape
from tests.server import AppFactory, LiveServer, start_server
from tests.services import free_port
from treadle import types

pytestmark = pytest.mark.integration

TOKEN = "metrics-token-0123456789"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
DASHBOARD = Path(__file__).resolve().parents[2] / "infra" / "grafana" / "treadle.json"

# --- protection ---------------------------------------------------------------------------------


def test_metrics_are_off_on_the_api_port_without_a_token(
    app_factory: AppFactory, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="api.app"), TestClient(app_factory()) as client:
        response = client.get("/metrics", headers=BEARER)
        unknown = client.get("/no-such-path")
    # Answered as any unknown path: an anonymous caller learns nothing of the settings.
    assert response.status_code == 404
    assert response.json() == {
        **unknown.json(),
        "detail": "no endpoint at /metrics; /openapi.json lists the endpoints",
    }
    assert "TREADLE_METRICS" not in response.text
    hints = [r.getMessage() for r in caplog.records if "TREADLE_METRICS_TOKEN" in r.getMessage()]
    assert len(hints) == 1 and "TREADLE_METRICS_PORT" in hints[0]


def test_metrics_need_the_bearer_token(app_factory: AppFactory) -> None:
    with TestClient(app_factory(metrics_token=TOKEN)) as client:
        assert client.get("/metrics").status_code == 401
        wrong = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}x"})
        assert wrong.status_code == 401
        assert wrong.headers["WWW-Authenticate"] == "Bearer"
        assert "TREADLE_METRICS_TOKEN" in wrong.json()["detail"]
        assert client.get("/metrics", headers={"Authorization": TOKEN}).status_code == 401
        basic = client.get("/metrics", headers={"Authorization": f"Basic {TOKEN}"})
        assert basic.status_code == 401
        # The scheme is case-insensitive (RFC 9110), the token is not.
        lower = client.get("/metrics", headers={"Authorization": f"bearer {TOKEN}"})
        assert lower.status_code == 200
        assert (
            client.get("/metrics", headers={"Authorization": "Bearer x" + TOKEN}).status_code == 401
        )
        response = client.get("/metrics", headers=BEARER)
        schema = client.get("/openapi.json").json()
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = parse(response.text)
    # The embedded server exports the fleet's gauges; the route is not in the API's schema.
    assert samples[("treadle_fleet_up", frozenset())] == 1
    assert ("treadle_active_sessions", frozenset()) in samples
    assert "/metrics" not in schema["paths"]


def test_the_metrics_port_serves_without_a_token(app_factory: AppFactory) -> None:
    port = free_port()
    with TestClient(app_factory(metrics_port=port)) as client:
        samples = scrape(f"http://127.0.0.1:{port}/metrics")
        assert client.get("/metrics").status_code == 404  # the API's own port stays closed
    assert samples[("treadle_fleet_up", frozenset())] == 1
    with pytest.raises(httpx.ConnectError):  # stopped with the app
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_rate_limited_answers_are_counted_by_reason_and_route(app_factory: AppFactory) -> None:
    app = app_factory(metrics_token=TOKEN, telemetry_per_minute=1)
    with TestClient(app) as client:
        key = tenant_factory(app.state.treadle.database, app.state.treadle.settings)().key
        before = parse(client.get("/metrics", headers=BEARER).text)
        answers = [
            client.post("/api/v1/telemetry", json={"events": []}, headers={"X-API-Key": key})
            for _ in range(3)
        ]
        after = parse(client.get("/metrics", headers=BEARER).text)
    assert [a.status_code for a in answers].count(429) == 2
    assert delta(before, after, "treadle_http_refusals_total", "status", "reason", "route") == {
        ("429", "rate_limited", "/api/v1/telemetry"): 2
    }
    assert delta(
        before, after, "treadle_http_request_duration_seconds_count", "route", "status_class"
    ) == {("/api/v1/telemetry", "2xx"): 1, ("/api/v1/telemetry", "4xx"): 2, ("/metrics", "2xx"): 1}


def test_unknown_methods_share_one_series(app_factory: AppFactory) -> None:
    with TestClient(app_factory(metrics_token=TOKEN)) as client:
        before = parse(client.get("/metrics", headers=BEARER).text)
        for method in ("BREW", "PROPFIND"):
            client.request(method, "/api/v1/healthz")
        after = parse(client.get("/metrics", headers=BEARER).text)
    grown = delta(before, after, "treadle_http_request_duration_seconds_count", "route", "method")
    assert grown[("/api/v1/healthz", "other")] == 2


# --- a scripted loop ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from start_server(tmp_path_factory.mktemp("metrics"), metrics_token=TOKEN)


def _scripted_loop(service: treadle.ServiceClient) -> None:
    """Two SFT steps, a request the engine refuses, a save for sampling and two samples."""
    trainer = service.create_lora_training_client(MODEL, rank=4, seed=1)
    for step in range(2):
        batch = [sft_datum(step * 2 + i, length=8 + i) for i in range(2)]
        trainer.forward_backward(batch, "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    broken = types.Datum(
        model_input=types.ModelInput.from_ints([10, 11, 12]),
        loss_fn_inputs={"target_tokens": types.TensorData.from_list([11, 12, 13], "int64")},
    )
    assert trainer.forward_backward([broken], "cross_entropy").exception(timeout=120)
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([30, 31, 32, 33])
    for seed in (1, 2):
        sampler.sample(prompt, 2, types.SamplingParams(max_tokens=5, seed=seed)).result()


def _ops(server: LiveServer) -> tuple[Counter[tuple[str, ...]], Counter[tuple[str, ...]]]:
    """The op log's ops by kind, and by (kind, outcome, category) as the metrics count them."""
    with server.database.reader() as db:
        rows = db.execute(select(Operation.kind, Operation.status, Operation.error_category)).all()
    by_kind = Counter((kind,) for kind, _, _ in rows)
    outcomes = Counter((kind, status, category or "") for kind, status, category in rows)
    return by_kind, outcomes


def _tokens(server: LiveServer) -> dict[tuple[str, ...], int]:
    with server.database.reader() as db:
        rows = db.execute(
            select(UsageEvent.kind, func.sum(UsageEvent.quantity))
            .where(UsageEvent.kind.in_(TOKEN_KINDS))
            .group_by(UsageEvent.kind)
        ).all()
    return {(kind,): int(total) for kind, total in rows}


@pytest.fixture(scope="module")
def loop(server: LiveServer) -> tuple[Samples, Samples]:
    """The server's metrics before and after the scripted loop (the session still open)."""
    url = f"{server.base_url}/metrics"
    before = scrape(url, BEARER)
    key = server.make_tenant().key
    with treadle.ServiceClient(base_url=server.base_url, api_key=key) as service:
        _scripted_loop(service)
        _, outcomes = _ops(server)

        def counted() -> bool:
            after = scrape(url, BEARER)
            finished = delta(before, after, "treadle_ops_finished_total", "kind", "outcome")
            return sum(finished.values()) == sum(outcomes.values())

        eventually(counted)
        after = scrape(url, BEARER)
    return before, after


def test_op_counts_equal_the_op_log(server: LiveServer, loop: tuple[Samples, Samples]) -> None:
    before, after = loop
    by_kind, outcomes = _ops(server)
    assert ("forward_backward", "failed", "user") in outcomes
    finished = delta(before, after, "treadle_ops_finished_total", "kind", "outcome", "category")
    assert finished == dict(outcomes)
    assert delta(before, after, "treadle_ops_submitted_total", "kind") == dict(by_kind)
    for histogram in ("queue_wait", "execution", "end_to_end"):
        name = f"treadle_op_{histogram}_seconds_count"
        assert delta(before, after, name, "kind") == dict(by_kind), histogram


def test_token_counts_equal_the_ledger(server: LiveServer, loop: tuple[Samples, Samples]) -> None:
    before, after = loop
    tokens = delta(before, after, "treadle_tokens_total", "kind")
    assert set(tokens) == {("training",), ("sampling_prefill",), ("sampling_sample",)}
    assert tokens == _tokens(server)


def test_requests_are_labelled_by_route_template(
    server: LiveServer, loop: tuple[Samples, Samples]
) -> None:
    _, after = loop
    routes = set(by(after, "treadle_http_request_duration_seconds_count", "route"))
    assert {("/api/v1/forward_backward",), ("/api/v1/retrieve_future",)} <= routes
    # Labels are templates, never URLs with the ids they carried (the registry is the
    # process's, so other tests' routes show too, those outside the schema included).
    ids = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}|:train:|:sample:|\btn_|\btml-|/\d+(/|$)")
    assert not [route for (route,) in routes if ids.search(route)]


def test_fleet_gauges_show_the_open_session(loop: tuple[Samples, Samples]) -> None:
    _, after = loop
    # The loop's one session and one training run are the server's only ones (module scope).
    assert after[("treadle_fleet_up", frozenset())] == 1
    assert after[("treadle_active_sessions", frozenset())] == 1
    assert after[("treadle_live_training_runs", frozenset())] == 1
    assert after[("treadle_unplaced_queued_ops", frozenset())] == 0


def _labels_by_metric(samples: Samples) -> dict[str, set[str]]:
    """The label names each exported sample name carries."""
    labels: dict[str, set[str]] = {}
    for name, labelset in samples:
        labels.setdefault(name, set()).update(label for label, _ in labelset)
    return labels


def test_the_dashboard_queries_only_exported_metrics_and_labels(
    loop: tuple[Samples, Samples],
) -> None:
    _, after = loop
    exported = _labels_by_metric(after)
    # Beat's own counter is exported by beat alone (test_beat_serves_the_fleet_and_failovers).
    exported["treadle_worker_failovers_total"] = set()
    targets = [
        target
        for panel in json.loads(DASHBOARD.read_text())["panels"]
        for target in panel.get("targets", [])
        if "expr" in target
    ]
    assert len(targets) >= 10
    missing, unlabelled = set(), set()
    for target in targets:
        names = set(re.findall(r"treadle_[a-z_]+", target["expr"]))
        carried: set[str] = set()
        for name in names:
            found = [
                exported[name + suffix]
                for suffix in ("", "_bucket", "_sum", "_count")
                if name + suffix in exported
            ]
            if not found:
                missing.add(name)
            carried.update(*found)
        used = {
            label.strip()
            for grouping in re.findall(r"by \(([^)]*)\)", target["expr"])
            for label in grouping.split(",")
        } | set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
        unlabelled |= {(label, target["expr"]) for label in used - carried}
    assert not missing, f"the dashboard queries metrics nothing exports: {sorted(missing)}"
    assert not unlabelled, f"the dashboard uses labels its metrics lack: {sorted(unlabelled)}"


# --- beat ---------------------------------------------------------------------------------------


def test_beat_serves_the_fleet_and_failovers(tmp_path: Path, sqlite_url: str) -> None:
    rows = Rows(migrated(sqlite_url))
    # Workers serving another model: the run's queued op stays unplaced, so no wake-up needs
    # Redis; one worker's lease lapses once the clock moves.
    rows.worker("w-staying", ["other/model"], lease_seconds=3600)
    rows.worker("w-lapsing", ["other/model"], lease_seconds=5)
    rows.run(rows.tenant())
    port = free_port()
    settings = make_settings(tmp_path, sqlite_url, metrics_port=port)
    url = f"http://127.0.0.1:{port}/metrics"
    stop = threading.Event()
    beat = threading.Thread(
        target=run_beat,
        args=(settings, rows.clock),
        kwargs={"interval_seconds": 0.05, "stop": stop},
    )
    beat.start()
    try:
        eventually(lambda: reachable(url))
        first = scrape(url)
        assert by(first, "treadle_workers", "status")[("live",)] == 2
        assert first[("treadle_unplaced_queued_ops", frozenset())] == 1
        lease = by(first, "treadle_worker_lease_expires_in_seconds", "worker")
        assert set(lease) == {("w-staying",), ("w-lapsing",)}
        rows.clock.advance(10)
        eventually(lambda: by(scrape(url), "treadle_workers", "status")[("dead",)] == 1)
        last = scrape(url)
    finally:
        stop.set()
        beat.join(timeout=60)
    assert not beat.is_alive()
    assert delta(first, last, "treadle_worker_failovers_total") == {(): 1}
    # A dead worker with nothing queued on it has no series of its own.
    assert set(by(last, "treadle_worker_adapter_bytes", "worker")) == {("w-staying",)}
    assert not reachable(url)  # beat stopped serving as it returned


# --- the fleet's gauges and the submitted count, from rows ---------------------------------------


def _gauges(rows: Rows) -> Samples:
    gauges = FleetGauges(rows.database, rows.clock)
    try:
        return {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in gauges.collect()
            for sample in family.samples
        }
    finally:
        gauges.close()


def test_the_fleet_gauges_split_the_queue_by_worker_exactly(database_url: str) -> None:
    rows = Rows(migrated(database_url))
    rows.worker("w-live", [MODEL])
    rows.worker("w-stranded", [MODEL], dead=True)
    rows.worker("w-gone", [MODEL], dead=True)
    tenant = rows.tenant()
    placed, stranded, _unplaced = rows.run(tenant), rows.run(tenant), rows.run(tenant)
    with rows.database.transaction() as db:
        for run_id, worker_id in ((placed, "w-live"), (stranded, "w-stranded")):
            run = db.get(TrainingRun, run_id)
            assert run is not None
            run.worker_id = worker_id
    rows.training_op(placed, 1)  # each run's create_model op is queued too
    samples = _gauges(rows)
    assert samples[("treadle_fleet_up", frozenset())] == 1
    assert by(samples, "treadle_worker_queued_ops", "worker") == {
        ("w-live",): 2,
        ("w-stranded",): 1,  # dead, but still holding queued ops: shown
    }
    assert samples[("treadle_unplaced_queued_ops", frozenset())] == 1
    assert by(samples, "treadle_workers", "status") == {
        ("live",): 1,
        ("draining",): 0,
        ("dead",): 2,
        ("left",): 0,
    }
    assert samples[("treadle_active_sessions", frozenset())] == 3
    with rows.database.reader() as db:
        assert fleet.queued_by_worker(db) == {"w-live": 2, "w-stranded": 1, None: 1}
        shown = fleet.workers(db, rows.clock.now(), shown_only=True)
    assert [w.worker_id for w in shown] == ["w-live", "w-stranded"]


def test_a_late_arrival_is_not_counted_as_submitted(sqlite_url: str) -> None:
    rows = Rows(migrated(sqlite_url))
    run = rows.run(rows.tenant())
    rows.training_op(run, 5)
    rows.executed(run, 5)  # seq 1..4 never came; their gap was released
    late = rows.training_op(run, 3)  # failed as it arrives: never queued, never recorded
    queued = rows.training_op(run, 6)
    assert late.queued_kind is None and not late.duplicate
    assert queued.queued_kind == "optim_step"
    assert rows.training_op(run, 6).queued_kind is None  # a resubmission
    with rows.database.reader() as db:
        statuses = {op.seq_id: op.status for op in db.scalars(select(Operation))}
    assert statuses[3] == OpStatus.FAILED and statuses[6] == OpStatus.QUEUED
