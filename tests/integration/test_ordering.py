"""Per-run ordering: out-of-order arrival waits for the gap to fill; a gap that never fills is
released after the timeout, and its straggler is refused with a user error."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from core.db import Database
from core.tables import Operation
from tests.builders import tenant_factory
from tests.integration.helpers import DATUM, MODEL, op, result
from tests.server import AppFactory

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def _server_with_run(
    app_factory: AppFactory, gap_timeout_seconds: float
) -> Iterator[tuple[TestClient, dict[str, str], str]]:
    """An embedded server with one tenant, one session and one created training run."""
    app = app_factory(gap_timeout_seconds=gap_timeout_seconds)
    state = app.state.treadle
    headers = {"X-API-Key": tenant_factory(state.database, state.settings)().key}
    with TestClient(app) as test_client:
        session = test_client.post("/api/v1/create_session", json={}, headers=headers).json()
        created = op(
            test_client,
            headers,
            "create_model",
            {
                "session_id": session["session_id"],
                "model_seq_id": 0,
                "base_model": MODEL,
                "lora_config": {"rank": 2},
            },
        )
        yield test_client, headers, str(created["model_id"])


@pytest.fixture
def client(app_factory: AppFactory) -> Iterator[tuple[TestClient, dict[str, str], str]]:
    with _server_with_run(app_factory, gap_timeout_seconds=1.5) as served:
        yield served


def _submit(client: TestClient, headers: dict[str, str], path: str, body: dict[str, object]) -> str:
    response = client.post(f"/api/v1/{path}", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return str(response.json()["request_id"])


def _fb(run_id: str, seq_id: int) -> dict[str, object]:
    return {"model_id": run_id, "seq_id": seq_id, "data": [DATUM], "loss_fn": "cross_entropy"}


def test_out_of_order_arrival_runs_in_seq_order(
    client: tuple[TestClient, dict[str, str], str],
) -> None:
    test_client, headers, run_id = client
    later = _submit(
        test_client,
        headers,
        "optim_step",
        {"model_id": run_id, "seq_id": 2, "adam_params": {"learning_rate": 0.01}},
    )
    time.sleep(0.3)  # seq 2 waits: seq 1 has not arrived
    database: Database = test_client.app.state.treadle.database  # type: ignore[attr-defined]
    with database.reader() as db:
        assert db.scalar(select(Operation.status).where(Operation.id == later)) == "queued"
    earlier = _submit(test_client, headers, "forward_backward", _fb(run_id, 1))
    result(test_client, headers, later)
    with database.reader() as db:
        finished = db.execute(
            select(Operation.id, Operation.finished_at).where(Operation.id.in_([earlier, later]))
        ).all()
    rows = {op_id: at for op_id, at in finished}
    assert rows[earlier] <= rows[later]


def test_a_gap_is_released_after_the_timeout_and_its_straggler_refused(
    client: tuple[TestClient, dict[str, str], str],
) -> None:
    test_client, headers, run_id = client
    started = time.monotonic()
    after_gap = _submit(test_client, headers, "forward_backward", _fb(run_id, 2))
    result(test_client, headers, after_gap)  # runs once the missing seq 1 is given up
    assert time.monotonic() - started >= 1.5
    straggler = _submit(test_client, headers, "forward_backward", _fb(run_id, 1))
    body = test_client.post(
        "/api/v1/retrieve_future", json={"request_id": straggler}, headers=headers
    ).json()
    assert body["category"] == "user"
    assert "after later requests" in body["error"]
    # The run goes on with the next seq_id.
    result(test_client, headers, _submit(test_client, headers, "forward_backward", _fb(run_id, 3)))


def test_a_refused_request_keeps_its_place_so_later_ones_never_wait(
    app_factory: AppFactory,
) -> None:
    """A request refused on its content (here: a checkpoint name already taken) still takes its
    seq_id and fails through its future; the next request runs at once, with no gap to wait out."""
    with _server_with_run(app_factory, gap_timeout_seconds=3600) as served:
        test_client, headers, run_id = served
        op(test_client, headers, "save_weights", {"model_id": run_id, "seq_id": 1, "path": "ckpt"})
        taken = _submit(
            test_client, headers, "save_weights", {"model_id": run_id, "seq_id": 2, "path": "ckpt"}
        )
        unsupported = _submit(
            test_client,
            headers,
            "optim_step",
            {
                "model_id": run_id,
                "seq_id": 3,
                "optimizer_params": {"type": "dimuon", "learning_rate": 0.01},
            },
        )
        for request_id, fragment in ((taken, "already exists"), (unsupported, "only AdamW")):
            body = test_client.post(
                "/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers
            ).json()
            assert body["category"] == "user" and fragment in body["error"], body
        result(
            test_client, headers, _submit(test_client, headers, "forward_backward", _fb(run_id, 4))
        )
