"""Hostile or broken input from a tenant gets a bounded 4xx naming what to change, never a 5xx,
and leaves sessions, runs, operations, checkpoints and usage exactly as they were (a refused
training request's place in its run's order aside).

The app runs in-process on SQLite and PostgreSQL; sessions and runs are made through the core
services, so no request here needs the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from api.jsonbody import MAX_JSON_DEPTH
from billing.tables import UsageEvent
from core import runs, sessions
from core.clock import FakeClock
from core.db import Database
from core.tables import ModelVersion, Operation, SamplingSession, TrainingRun
from core.tables import Session as SessionRow
from scheduler.oplog import UNLOAD_SEQ
from scheduler.ops import refusal_of
from tests import services
from tests.builders import tenant_factory
from tests.server import build_app
from treadle.types.bounds import MAX_SEQ_ID

pytestmark = pytest.mark.integration

MODEL = "treadle/tiny-1m"
MAX_REPLY_BYTES = 8192
_SERVER_LOGGERS = {"api", "core", "fastapi", "starlette", "uvicorn"}


@dataclasses.dataclass
class Env:
    app: FastAPI
    client: TestClient
    clock: FakeClock
    headers: dict[str, str]
    session_id: str
    run_id: str
    new_run: Any

    @property
    def database(self) -> Database:
        database: Database = self.app.state.treadle.database
        return database

    def snapshot(self) -> dict[str, object]:
        """Everything a refused request must leave as it was.

        A refused training request that names its run and seq_id leaves one thing: its refusal,
        queued in its place in the run's order (see api/refusals.py); that is not counted.
        """
        with self.database.reader() as db:
            counts = {
                table.__tablename__: db.scalar(select(func.count()).select_from(table))
                for table in (SessionRow, TrainingRun, SamplingSession, ModelVersion, UsageEvent)
            }
            counts["operations"] = sum(
                1
                for op in db.scalars(select(Operation))
                if refusal_of(op.payload, op.payload_codec) is None
            )
            run_rows = db.execute(
                select(TrainingRun.id, TrainingRun.status, TrainingRun.executed_seq_id)
            ).all()
            session_rows = db.execute(
                select(SessionRow.id, SessionRow.status, SessionRow.last_heartbeat_at)
            ).all()
        return {"counts": counts, "runs": sorted(run_rows), "sessions": sorted(session_rows)}

    def post(self, route: str, body: Any) -> Any:
        return self.client.post(f"/api/v1/{route}", json=body, headers=self.headers)


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp(f"bad-input-{request.param}")
    database: contextlib.AbstractContextManager[str]
    if request.param == "sqlite":
        database = contextlib.nullcontext(f"sqlite:///{root / 'treadle.db'}")
    else:
        database = services.throwaway_database(request.getfixturevalue("postgres_admin_url"))
    with database as url:
        clock = FakeClock()
        # Runs made here never get their creation op: keep the engine from giving up on it.
        app = build_app(root, url, clock=clock, gap_timeout_seconds=3600.0)
        with TestClient(app) as client:
            state = app.state.treadle
            tenant = tenant_factory(state.database, state.settings, clock)()
            with state.database.transaction() as db:
                session = sessions.create_session(
                    db, clock, tenant_id=tenant.tenant_id, api_key_id=None, ttl_seconds=1e6
                )
            seqs = iter(range(1_000))

            def new_run() -> str:
                with state.database.transaction() as db:
                    run, _ = runs.create_training_run(
                        db,
                        clock,
                        tenant_id=tenant.tenant_id,
                        session_id=session.id,
                        model_seq_id=next(seqs),
                        base_model=MODEL,
                        lora_config={"rank": 4},
                        user_metadata=None,
                    )
                    return run.id

            yield Env(app, client, clock, {"X-API-Key": tenant.key}, session.id, new_run(), new_run)


def _assert_bounded_refusal(response: Any, *fragments: str) -> str:
    assert 400 <= response.status_code < 500, response.text[:500]
    assert len(response.content) <= MAX_REPLY_BYTES, len(response.content)
    body = json.loads(response.content)  # valid JSON, without NaN or Infinity tokens
    assert response.headers["x-should-retry"] == "false"
    if response.url.path.startswith("/oai/"):  # OpenAI's error format
        assert body["error"]["type"] == "invalid_request_error"
        detail: str = body["error"]["message"]
    else:
        assert body["category"] == "user"
        detail = body["detail"]
    for fragment in fragments:
        assert fragment in detail, detail
    return detail


def _post_routes(app: FastAPI) -> list[str]:
    """Every POST path the API serves, as its OpenAPI document lists them."""
    paths = []
    for path, operations in app.openapi()["paths"].items():
        if "post" in operations:
            # Any value fits the path parameters: the body is refused before they matter.
            paths.append(re.sub(r"\{(\w+)(:\w+)?\}", "x", path.replace("{kind}", "weights")))
    return paths


def test_every_post_route_refuses_nan_and_infinity_with_one_bounded_answer(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """NaN and Infinity are not JSON; a body holding them once made 18 routes answer 500 with a
    traceback in the log, because the error handler echoed them back into a JSON reply."""
    routes = _post_routes(env.app)
    assert len(routes) >= 20
    before = env.snapshot()
    padding = "A" * 100_000
    for path in routes:
        for headers in (env.headers, {}):  # /client/config needs no key: neither may fail
            body = f'{{"session_id": NaN, "x": [Infinity, -Infinity], "pad": "{padding}"}}'
            caplog.clear()
            with caplog.at_level(logging.DEBUG):
                response = env.client.post(
                    path,
                    content=body,
                    headers={**headers, "Content-Type": "application/json"},
                )
            _assert_bounded_refusal(response, "NaN or Infinity")
            assert "A" * 201 not in response.text
            # The server's own records (the engine thread may log at any time).
            logged = [r for r in caplog.records if r.name.split(".")[0] in _SERVER_LOGGERS]
            assert len(logged) <= 1, [r.getMessage()[:200] for r in logged]
    assert env.snapshot() == before


def test_validation_errors_repeat_at_most_a_little_of_the_input(env: Env) -> None:
    before = env.snapshot()
    long_key, long_value = "K" * 10_000, "V" * 200_000
    for path in _post_routes(env.app):
        if path.endswith(("/forward_backward", "/telemetry")):
            continue  # these two read their bodies themselves
        body = {
            long_key: long_value,
            "session_id": [long_value, {"deep": [[[[[long_value]]]]]}],
            "model_id": {"x": 1.5e308},
            "seq_id": "L" * 50_000,
            **{f"extra_{i}": i for i in range(100)},
        }
        response = env.client.post(path, json=body, headers=env.headers)
        detail = _assert_bounded_refusal(response)
        for filler in ("K", "V", "L"):
            assert filler * 201 not in response.text, (path, detail[:300])
    assert env.snapshot() == before


@pytest.mark.parametrize(
    ("route", "body", "field", "allowed"),
    [
        ("create_model", {"model_seq_id": 2**63}, "model_seq_id", "0 to 2147483647"),
        ("create_model", {"model_seq_id": -1}, "model_seq_id", "0 to 2147483647"),
        (
            "create_model",
            {"model_seq_id": 90, "lora_config": {"rank": 4, "seed": 2**64}},
            "lora_config.seed",
            "0 to 18446744073709551615",
        ),
        (
            "create_model",
            {"model_seq_id": 91, "lora_config": {"rank": 4, "seed": -1}},
            "lora_config.seed",
            "0 to 18446744073709551615",
        ),
        (
            "create_sampling_session",
            {"sampling_session_seq_id": 2**63},
            "sampling_session_seq_id",
            "0 to 2147483647",
        ),
        (
            "create_sampling_session",
            {"sampling_session_seq_id": -3},
            "sampling_session_seq_id",
            "0 to 2147483647",
        ),
        ("optim_step", {"seq_id": 2**64}, "seq_id", f"1 to {MAX_SEQ_ID}"),
        ("optim_step", {"seq_id": -1}, "seq_id", f"1 to {MAX_SEQ_ID}"),
        ("save_weights", {"seq_id": 2**53, "path": "a"}, "seq_id", f"1 to {MAX_SEQ_ID}"),
        (
            "save_weights_for_sampler",
            {"seq_id": 5, "sampling_session_seq_id": -1},
            "sampling_session_seq_id",
            "0 to 2147483647",
        ),
        (
            "load_weights",
            {"model_seq_id": 2**31, "path": "tinker://r/weights/a", "optimizer": False},
            "model_seq_id",
            "0 to 2147483647",
        ),
        ("asample", {"seq_id": -1}, "seq_id", "0 to 9223372036854775807"),
        ("asample", {"seq_id": 2**63}, "seq_id", "0 to 9223372036854775807"),
        (
            "asample",
            {"seq_id": 0, "sampling_params": {"seed": 2**64}},
            "sampling_params.seed",
            "0 to 18446744073709551615",
        ),
        (
            "asample",
            {"seq_id": 0, "topk_prompt_logprobs": 10**9},
            "topk_prompt_logprobs",
            "0 to 128",
        ),
    ],
)
def test_numbers_outside_their_range_are_refused_naming_field_and_range(
    env: Env, route: str, body: dict[str, Any], field: str, allowed: str
) -> None:
    defaults: dict[str, dict[str, Any]] = {
        "create_model": {"session_id": env.session_id, "base_model": MODEL},
        "create_sampling_session": {"session_id": env.session_id, "base_model": MODEL},
        "optim_step": {"model_id": env.run_id, "adam_params": {}},
        "save_weights": {"model_id": env.run_id},
        "save_weights_for_sampler": {"model_id": env.run_id},
        "load_weights": {"session_id": env.session_id},
        "asample": {
            "sampling_session_id": f"{env.session_id}:sample:0",
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
            "sampling_params": {},
        },
    }
    before = env.snapshot()
    response = env.post(route, {**defaults[route], **body})
    _assert_bounded_refusal(response, f"{field}: ", allowed)
    assert env.snapshot() == before


@pytest.mark.parametrize(
    ("field", "limit"), [("sdk_version", 64), ("project_id", 200), ("display_name", 200)]
)
def test_session_names_longer_than_kept_are_refused(env: Env, field: str, limit: int) -> None:
    before = env.snapshot()
    response = env.post("create_session", {field: "n" * (limit + 1)})
    _assert_bounded_refusal(response, f"{field}: ", f"at most {limit} characters")
    assert env.snapshot() == before
    assert env.post("create_session", {field: "n" * limit}).status_code == 200


@pytest.mark.parametrize(
    ("route", "body", "field", "limit"),
    [
        ("get_info", {"model_id": "m" * 100_000}, "model_id", 128),
        ("session_heartbeat", {"session_id": "s" * 129}, "session_id", 128),
        ("retrieve_future", {"request_id": "r" * 5000}, "request_id", 128),
        (
            "create_model",
            {"session_id": "s", "model_seq_id": 0, "base_model": "b" * 201},
            "base_model",
            200,
        ),
        (
            "weights_info",
            {"tinker_path": "tinker://" + "p" * 600},
            "tinker_path",
            512,
        ),
    ],
)
def test_ids_names_and_paths_longer_than_any_real_one_are_refused(
    env: Env, route: str, body: dict[str, Any], field: str, limit: int
) -> None:
    before = env.snapshot()
    response = env.post(route, body)
    _assert_bounded_refusal(response, f"{field}: ", f"at most {limit} characters")
    assert len(response.content) < 2000
    assert env.snapshot() == before


@pytest.mark.parametrize(
    "path",
    ["/training_runs", "/sessions", "/checkpoints", "/training_runs/{run}/checkpoints"],
)
def test_listing_offsets_beyond_int64_are_refused(env: Env, path: str) -> None:
    url = "/api/v1" + path.format(run=env.run_id)
    for offset in (2**63, 10**30):
        response = env.client.get(url, params={"offset": offset}, headers=env.headers)
        _assert_bounded_refusal(response, "offset", "2147483647")
    far = env.client.get(url, params={"offset": 2**31 - 1}, headers=env.headers)
    assert far.status_code == 200, far.text


def test_seq_ids_stay_below_the_unload_marker_so_a_run_can_always_unload(env: Env) -> None:
    """seq_id 2**62 once took the place of the run's unload_model and bricked the run."""
    assert UNLOAD_SEQ > MAX_SEQ_ID
    run_id = env.new_run()
    before = env.snapshot()
    for seq_id in (UNLOAD_SEQ, MAX_SEQ_ID + 1, 0):
        response = env.post("optim_step", {"model_id": run_id, "seq_id": seq_id, "adam_params": {}})
        _assert_bounded_refusal(response, "seq_id")
    assert env.snapshot() == before
    top = env.post("optim_step", {"model_id": run_id, "seq_id": MAX_SEQ_ID, "adam_params": {}})
    assert top.status_code == 200, top.text
    unload = env.post("unload_model", {"model_id": run_id})
    assert unload.status_code == 200, unload.text
    with env.database.reader() as db:
        kinds = db.execute(
            select(Operation.seq_id, Operation.kind).where(Operation.target_id == run_id)
        ).all()
    assert sorted(kinds) == [(MAX_SEQ_ID, "optim_step"), (UNLOAD_SEQ, "unload_model")]


@pytest.mark.parametrize(
    "name",
    [
        "a\x00b",
        "x" * 256,
        "é" * 128,  # 128 characters, 256 bytes
        "",
        ".hidden",
        "../../etc",
        "a/b",
        "step 5",
        " step-5",
        "step-5 ",
        "what?",
        "x#y",
        "tab\there",
        "evil\u202etxt.exe",
        "{low}",
    ],
)
def test_checkpoint_names_outside_the_safe_set_are_refused(env: Env, name: str) -> None:
    before = env.snapshot()
    for route in ("save_weights", "save_weights_for_sampler", "save_weights_external"):
        response = env.post(route, {"model_id": env.run_id, "seq_id": 7, "path": name})
        detail = _assert_bounded_refusal(
            response, "path: checkpoint name", "letters, digits, '.', '_' and '-'"
        )
        assert "\x00" not in detail and "x" * 41 not in detail
    assert env.snapshot() == before


def test_names_in_the_safe_set_are_accepted(env: Env) -> None:
    run_id = env.new_run()
    names = ["000010", "final", "step-5", "a.b_c-d", "-x", "x" * 255]
    for seq_id, name in enumerate(names, start=1):
        response = env.post("save_weights", {"model_id": run_id, "seq_id": seq_id, "path": name})
        assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("params", "field", "allowed"),
    [
        ({"learning_rate": 1e308}, "adam_params.learning_rate", "[0, 1000]"),
        ({"learning_rate": -1e-4}, "adam_params.learning_rate", "[0, 1000]"),
        ({"learning_rate": "NaN"}, "adam_params.learning_rate", "[0, 1000]"),
        ({"beta1": 1.0}, "adam_params.beta1", "[0, 1)"),
        ({"beta2": -0.1}, "adam_params.beta2", "[0, 1)"),
        ({"eps": 0.0}, "adam_params.eps", "(0, ∞)"),
        ({"eps": "Infinity"}, "adam_params.eps", "(0, ∞)"),
        ({"weight_decay": -0.01}, "adam_params.weight_decay", "[0, ∞)"),
        ({"grad_clip_norm": "-Infinity"}, "adam_params.grad_clip_norm", "[0, ∞)"),
    ],
)
def test_adam_parameters_outside_their_bounds_are_refused(
    env: Env, params: dict[str, Any], field: str, allowed: str
) -> None:
    before = env.snapshot()
    response = env.post("optim_step", {"model_id": env.run_id, "seq_id": 3, "adam_params": params})
    _assert_bounded_refusal(response, f"{field}: must be a finite number in {allowed}")
    assert env.snapshot() == before


def test_adam_parameters_at_their_bounds_are_accepted(env: Env) -> None:
    run_id = env.new_run()
    edges = [
        {"learning_rate": 0.0},  # schedules end at 0
        {"learning_rate": 1000.0, "beta1": 0.0, "beta2": 0.999999},
        {"eps": 1e-300, "weight_decay": 0.0, "grad_clip_norm": 0.0},
    ]
    for seq_id, params in enumerate(edges, start=1):
        response = env.post(
            "optim_step", {"model_id": run_id, "seq_id": seq_id, "adam_params": params}
        )
        assert response.status_code == 200, response.text


def _nested_metadata(depth: int) -> str:
    """A create_session body whose nesting, the body's own object included, is `depth`."""
    inner = "1"
    for _ in range(depth - 2):
        inner = "[" + inner + "]"
    return '{"user_metadata": {"a": ' + inner + "}}"


def test_bodies_nested_deeper_than_the_bound_are_refused(env: Env) -> None:
    json_headers = {**env.headers, "Content-Type": "application/json"}
    fine = env.client.post(
        "/api/v1/create_session", content=_nested_metadata(MAX_JSON_DEPTH), headers=json_headers
    )
    assert fine.status_code == 200, fine.text
    # Brackets inside strings are text, however many.
    text = env.client.post(
        "/api/v1/create_session", json={"tags": ["[" * 10_000, "{" * 10_000]}, headers=env.headers
    )
    assert text.status_code == 200, text.text
    before = env.snapshot()
    for depth in (MAX_JSON_DEPTH + 1, 500, 990, 100_000):
        body = _nested_metadata(depth)
        for route in ("create_session", "telemetry", "optim_step"):
            response = env.client.post(f"/api/v1/{route}", content=body, headers=json_headers)
            _assert_bounded_refusal(response, f"more than {MAX_JSON_DEPTH} levels")
    # The telemetry route reads its body whatever the content type claims.
    plain = env.client.post(
        "/api/v1/telemetry",
        content="[" * 5000 + "]" * 5000,
        headers={**env.headers, "Content-Type": "text/plain"},
    )
    _assert_bounded_refusal(plain, f"more than {MAX_JSON_DEPTH} levels")
    assert env.snapshot() == before


def test_a_forward_backward_body_of_many_bad_datums_gets_a_short_answer(env: Env) -> None:
    bad_datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": ["W" * 300]}]}}
    body = {
        "model_id": env.run_id,
        "seq_id": 1,
        "loss_fn": "cross_entropy",
        "data": [bad_datum] * 5000,
    }
    before = env.snapshot()
    response = env.post("forward_backward", body)
    _assert_bounded_refusal(response, "invalid forward_backward request: data.0.", "more problems")
    assert "W" * 201 not in response.text
    out_of_range = env.post("forward_backward", {**body, "data": [], "seq_id": UNLOAD_SEQ})
    _assert_bounded_refusal(out_of_range, "seq_id: must be an integer from 0 to")
    assert env.snapshot() == before
