"""A stored request that the API would refuse today (queued before its bounds existed, or
written by other means) fails its own op as a `user` error at the worker, never a `server`
one, and the run goes on with its next request."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from core.tables import TrainingRun
from gpu_worker.protocol import AdamParams, UserInputError
from gpu_worker.validation import check_adam
from scheduler.ops import OpKind, encode_json_payload
from scheduler.submit import submit_training_op
from tests.builders import tenant_factory
from tests.server import AppFactory

pytestmark = pytest.mark.integration

MODEL = "treadle/tiny-1m"


def _outcome(client: TestClient, headers: dict[str, str], request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        body: dict[str, Any] = client.post(
            "/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers
        ).json()
        if body.get("type") != "try_again":
            return body
    raise AssertionError(f"{request_id} never finished")


@pytest.fixture
def served(
    app_factory: AppFactory, database_url: str
) -> Iterator[tuple[TestClient, dict[str, str], str]]:
    app = app_factory(database_url, long_poll_seconds=1.0)
    state = app.state.treadle
    headers = {"X-API-Key": tenant_factory(state.database, state.settings)().key}
    with TestClient(app) as client:
        session_id = client.post("/api/v1/create_session", json={}, headers=headers).json()[
            "session_id"
        ]
        created = client.post(
            "/api/v1/create_model",
            json={"session_id": session_id, "model_seq_id": 0, "base_model": MODEL},
            headers=headers,
        ).json()
        assert "error" not in _outcome(client, headers, created["request_id"])
        yield client, headers, created["model_id"]


def _stored_optim_step(client: TestClient, run_id: str, seq_id: int, adam: dict[str, Any]) -> str:
    """An optim_step written straight to the op log, as an older server accepted it."""
    state = client.app.state.treadle  # type: ignore[attr-defined]
    payload, codec = encode_json_payload(
        {"model_id": run_id, "seq_id": seq_id, "adam_params": adam, "type": "optim_step"}
    )
    with state.database.transaction() as db:
        run = db.get(TrainingRun, run_id)
        assert run is not None
        submitted = submit_training_op(
            db,
            state.clock,
            run=run,
            seq_id=seq_id,
            kind=OpKind.OPTIM_STEP,
            payload=payload,
            payload_codec=codec,
        )
    state.dispatcher.wake()
    return submitted.request_id


def test_stored_requests_outside_the_bounds_fail_as_user_errors(
    served: tuple[TestClient, dict[str, str], str],
) -> None:
    client, headers, run_id = served
    huge_lr = _stored_optim_step(client, run_id, 1, {"learning_rate": 1e308})
    no_eps = _stored_optim_step(client, run_id, 2, {"eps": 0.0})
    for request_id, field in ((huge_lr, "learning_rate"), (no_eps, "eps")):
        body = _outcome(client, headers, request_id)
        assert body["category"] == "user", body
        assert f"adam_params.{field}: must be a finite number" in body["error"]
    after = client.post(
        "/api/v1/optim_step",
        json={"model_id": run_id, "seq_id": 3, "adam_params": {"learning_rate": 1e-3}},
        headers=headers,
    )
    assert after.status_code == 200, after.text
    assert "error" not in _outcome(client, headers, after.json()["request_id"])


def test_the_engine_holds_the_same_adam_bounds() -> None:
    check_adam(AdamParams(learning_rate=1000.0, eps=1e-30))
    for params, fragment in (
        (AdamParams(learning_rate=1e308), "exceeds 1000"),
        (AdamParams(eps=0.0), "eps must be > 0"),
        (AdamParams(beta2=1.0), "must be < 1"),
        (AdamParams(weight_decay=float("inf")), "weight_decay must be a finite number"),
    ):
        with pytest.raises(UserInputError, match=fragment):
            check_adam(params)
