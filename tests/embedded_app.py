"""An embedded Treadle app in-process, with tenants and the op round trip, for integration tests.

It drives the app through HTTP (Starlette's TestClient) exactly as a client would, and gives
tests the database to inspect and to write ops into directly when a test must place several
ops in one engine tick.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from api.deps import AppState
from core.db import Database
from core.settings import Settings
from core.tables import TrainingRun
from scheduler.ops import OpKind, encode_proto_payload
from scheduler.submit import submit_training_op
from tests.builders import tenant_factory
from tests.server import build_app

MODEL = "treadle/tiny-1m"


def datum(tokens: list[int]) -> dict[str, Any]:
    """A cross-entropy datum in JSON form: predict each next token of `tokens`."""
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": tokens[1:], "dtype": "int64"},
            "weights": {"data": [1.0] * (len(tokens) - 1), "dtype": "float32"},
        },
    }


class EmbeddedApp:
    def __init__(self, client: TestClient, settings: Settings) -> None:
        self.client = client
        self.settings = settings
        self.state: AppState = client.app.state.treadle  # type: ignore[attr-defined]
        self.database: Database = self.state.database
        self._tenants = tenant_factory(self.database, settings)

    def tenant(self, **limits: Any) -> dict[str, str]:
        """A new tenant's request headers (its API key)."""
        return {"X-API-Key": self._tenants(**limits).key}

    def post(
        self, headers: dict[str, str], route: str, body: Any = None, **kwargs: Any
    ) -> Any:  # the TestClient's response
        return self.client.post(f"/api/v1/{route}", json=body, headers=headers, **kwargs)

    def submit(self, headers: dict[str, str], route: str, body: dict[str, Any]) -> str:
        response = self.post(headers, route, body)
        assert response.status_code == 200, response.text
        return str(response.json()["request_id"])

    def result(self, headers: dict[str, str], request_id: str) -> dict[str, Any]:
        """The future's final body: the result, or `{"error", "category"}`."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            body: dict[str, Any] = self.post(
                headers, "retrieve_future", {"request_id": request_id}
            ).json()
            if body.get("type") != "try_again":
                return body
        raise AssertionError(f"request {request_id} did not finish")

    def op(self, headers: dict[str, str], route: str, body: dict[str, Any]) -> dict[str, Any]:
        """Submit and wait; the op must succeed."""
        result = self.result(headers, self.submit(headers, route, body))
        assert "error" not in result, result
        return result

    def log_together(self, ops: list[tuple[str, int, bytes]]) -> list[str]:
        """Write forward_backward ops (run id, seq id, protobuf body) into the op log in one
        transaction, bypassing the API's checks, so that one engine tick claims them all."""
        ids = []
        with self.database.transaction() as db:
            for run_id, seq_id, body in ops:
                run = db.get(TrainingRun, run_id)
                assert run is not None
                payload, codec = encode_proto_payload(body)
                submitted = submit_training_op(
                    db,
                    self.state.clock,
                    run=run,
                    seq_id=seq_id,
                    kind=OpKind.FORWARD_BACKWARD,
                    payload=payload,
                    payload_codec=codec,
                )
                ids.append(submitted.request_id)
        self.state.dispatcher.wake()
        return ids

    def session(self, headers: dict[str, str]) -> str:
        response = self.post(headers, "create_session", {})
        assert response.status_code == 200, response.text
        return str(response.json()["session_id"])

    def run(self, headers: dict[str, str], *, rank: int = 2, seed: int = 0) -> str:
        """A new session with one created training run; returns the run id."""
        created = self.op(
            headers,
            "create_model",
            {
                "session_id": self.session(headers),
                "model_seq_id": 0,
                "base_model": MODEL,
                "lora_config": {"rank": rank, "seed": seed},
            },
        )
        return str(created["model_id"])


@contextlib.contextmanager
def embedded_app(
    tmp_path: Path,
    database_url: str | None = None,
    *,
    raise_server_exceptions: bool = True,
    **overrides: Any,
) -> Iterator[EmbeddedApp]:
    """An embedded app on a migrated database (SQLite under `tmp_path` unless given).

    With `raise_server_exceptions=False` a fault in a route answers 500 as in production,
    instead of raising in the test.
    """
    app = build_app(tmp_path, database_url, **overrides)
    with TestClient(app, raise_server_exceptions=raise_server_exceptions) as client:
        yield EmbeddedApp(client, app.state.treadle.settings)
