"""A run whose engine state was lost (server restart, dead worker) is rebuilt from its snapshot
and op log, and continues exactly where it was."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from api.app import create_app
from billing.tables import UsageEvent
from core.db import Database
from core.tables import TrainingRun
from tests.builders import tenant_factory
from tests.integration.helpers import DATUM, MODEL, op
from tests.server import AppFactory

pytestmark = pytest.mark.integration


def _train(
    client: TestClient, headers: dict[str, str], session_id: str, model_seq_id: int, steps: int
) -> str:
    run_id = str(
        op(
            client,
            headers,
            "create_model",
            {
                "session_id": session_id,
                "model_seq_id": model_seq_id,
                "base_model": MODEL,
                "lora_config": {"rank": 4, "seed": 3},
            },
        )["model_id"]
    )
    for step in range(steps):
        op(
            client,
            headers,
            "forward_backward",
            {
                "model_id": run_id,
                "seq_id": 2 * step + 1,
                "data": [DATUM],
                "loss_fn": "cross_entropy",
            },
        )
        op(
            client,
            headers,
            "optim_step",
            {"model_id": run_id, "seq_id": 2 * step + 2, "adam_params": {"learning_rate": 0.01}},
        )
    return run_id


def _forward_loss(client: TestClient, headers: dict[str, str], run_id: str, seq_id: int) -> float:
    out = op(
        client,
        headers,
        "forward_backward",
        {
            "model_id": run_id,
            "seq_id": seq_id,
            "data": [DATUM],
            "loss_fn": "cross_entropy",
            "forward_only": True,
        },
    )
    metrics = out["metrics"]
    assert isinstance(metrics, dict)
    return float(metrics["loss:sum"])


@pytest.mark.parametrize("snapshot_every_steps", [2, 1000])
def test_restarted_server_restores_runs(app_factory: AppFactory, snapshot_every_steps: int) -> None:
    app = app_factory(snapshot_every_steps=snapshot_every_steps)
    settings = app.state.treadle.settings
    key = tenant_factory(app.state.treadle.database, settings)().key
    headers = {"X-API-Key": key}
    with TestClient(app) as client:
        session_id = client.post("/api/v1/create_session", json={}, headers=headers).json()[
            "session_id"
        ]
        survivor = _train(client, headers, session_id, 0, steps=3)
        reference = _train(client, headers, session_id, 1, steps=4)
        expected = _forward_loss(client, headers, reference, seq_id=9)

    with Database(settings.resolved_database_url).reader() as db:
        billed = db.scalar(select(func.sum(UsageEvent.quantity)))
    restarted = create_app(settings)  # a new engine that holds no runs
    with TestClient(restarted) as client:
        op(
            client,
            headers,
            "forward_backward",
            {"model_id": survivor, "seq_id": 7, "data": [DATUM], "loss_fn": "cross_entropy"},
        )
        op(
            client,
            headers,
            "optim_step",
            {"model_id": survivor, "seq_id": 8, "adam_params": {"learning_rate": 0.01}},
        )
        assert _forward_loss(client, headers, survivor, seq_id=9) == pytest.approx(
            expected, rel=1e-6
        )
    with Database(settings.resolved_database_url).reader() as db:
        # Replayed ops are not billed again: only the new forward_backward and forward added
        # usage (20 tokens each; an optimizer step processes no tokens).
        assert db.scalar(select(func.sum(UsageEvent.quantity))) == (billed or 0) + 2 * 20
        # Nor counted again as trained: three steps' tokens and the new one's (a forward pass
        # trains nothing).
        survivor_run = db.get(TrainingRun, survivor)
        assert survivor_run is not None and survivor_run.tokens_trained == 4 * 20


def _failure(
    client: TestClient,
    headers: dict[str, str],
    path: str,
    body: dict[str, object],
    category: str = "user",
) -> str:
    """Submit an op that must fail through its future with an error of `category`; returns
    the error."""
    response = client.post(f"/api/v1/{path}", json=body, headers=headers)
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        answer = client.post(
            "/api/v1/retrieve_future",
            json={"request_id": response.json()["request_id"]},
            headers=headers,
        ).json()
        if answer.get("type") != "try_again":
            assert answer.get("category") == category, answer
            return str(answer["error"])
    raise AssertionError("no result")


def test_replay_repeats_steps_refused_after_a_failed_forward_backward(
    app_factory: AppFactory,
) -> None:
    """A refused optim_step discarded its window's gradients; replay after a restart discards
    them too, and a window left open across the restart is refused by the restarted server."""
    app = app_factory(snapshot_every_steps=1000)  # replay from creation
    settings = app.state.treadle.settings
    inputs = DATUM["loss_fn_inputs"]
    assert isinstance(inputs, dict)
    unweighted = {**DATUM, "loss_fn_inputs": {"target_tokens": inputs["target_tokens"]}}
    adam = {"adam_params": {"learning_rate": 0.01}}
    key = tenant_factory(app.state.treadle.database, settings)().key
    headers = {"X-API-Key": key}

    def fb(client: TestClient, run_id: str, seq_id: int, datum: dict[str, object]) -> None:
        body = {"model_id": run_id, "seq_id": seq_id, "data": [datum], "loss_fn": "cross_entropy"}
        if datum is DATUM:
            op(client, headers, "forward_backward", body)
        else:
            _failure(client, headers, "forward_backward", body)

    with TestClient(app) as client:
        session_id = client.post("/api/v1/create_session", json={}, headers=headers).json()[
            "session_id"
        ]
        reference = _train(client, headers, session_id, 0, steps=1)
        expected = _forward_loss(client, headers, reference, seq_id=3)
        fb(client, reference, 4, DATUM)
        op(client, headers, "optim_step", {"model_id": reference, "seq_id": 5, **adam})
        expected_second = _forward_loss(client, headers, reference, seq_id=6)
        run_id = _train(client, headers, session_id, 1, steps=0)
        fb(client, run_id, 1, DATUM)
        fb(client, run_id, 2, unweighted)
        error = _failure(client, headers, "optim_step", {"model_id": run_id, "seq_id": 3, **adam})
        assert "(seq_id 2) failed" in error and "weights" in error, error
        fb(client, run_id, 4, DATUM)
        op(client, headers, "optim_step", {"model_id": run_id, "seq_id": 5, **adam})
        assert _forward_loss(client, headers, run_id, seq_id=6) == pytest.approx(expected, rel=1e-6)
        fb(client, run_id, 7, DATUM)
        fb(client, run_id, 8, unweighted)

    restarted = create_app(settings)  # a new engine that holds no runs
    with TestClient(restarted) as client:
        error = _failure(client, headers, "optim_step", {"model_id": run_id, "seq_id": 9, **adam})
        assert "(seq_id 8) failed" in error, error
        # Replay left the run as the uninterrupted one was: one step, on one good batch.
        assert _forward_loss(client, headers, run_id, seq_id=10) == pytest.approx(
            expected, rel=1e-6
        )
        fb(client, run_id, 11, DATUM)
        op(client, headers, "optim_step", {"model_id": run_id, "seq_id": 12, **adam})
        assert _forward_loss(client, headers, run_id, seq_id=13) == pytest.approx(
            expected_second, rel=1e-6
        )


def test_a_run_that_cannot_be_restored_fails_and_its_next_requests_are_refused(
    app_factory: AppFactory,
) -> None:
    app = app_factory(snapshot_every_steps=2)
    state = app.state.treadle
    key = tenant_factory(state.database, state.settings)().key
    headers = {"X-API-Key": key}
    with TestClient(app) as client:
        session_id = client.post("/api/v1/create_session", json={}, headers=headers).json()[
            "session_id"
        ]
        run_id = _train(client, headers, session_id, 0, steps=2)
    with state.database.reader() as db:
        run = db.get(TrainingRun, run_id)
        assert run is not None and run.snapshot_uri is not None
        snapshot = run.snapshot_uri
    state.store.delete(snapshot)  # what the restore needs is gone

    restarted = create_app(state.settings)  # a new engine that holds no runs
    with TestClient(restarted) as client:
        fb = {"model_id": run_id, "seq_id": 5, "data": [DATUM], "loss_fn": "cross_entropy"}
        error = _failure(client, headers, "forward_backward", fb, category="server")
        assert "missing from the artifact store" in error, error
        with state.database.reader() as db:
            run = db.get(TrainingRun, run_id)
            assert run is not None and run.status == "failed"
        # Its next request is refused at once, saying what happened and what to do.
        step = {"model_id": run_id, "seq_id": 6, "adam_params": {"learning_rate": 0.01}}
        refused = client.post("/api/v1/optim_step", json=step, headers=headers)
        assert refused.status_code == 422, refused.text
        message = refused.json()["detail"]
        assert f"training run {run_id} failed" in message, message
        assert "create a new training client" in message, message
