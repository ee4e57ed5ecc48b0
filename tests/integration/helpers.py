"""Helpers of the integration tests: a datum and the op round trip through a TestClient."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

MODEL = "treadle/tiny-1m"
TOKENS = [(5 * i) % 300 + 10 for i in range(21)]
DATUM = {
    "model_input": {"chunks": [{"type": "encoded_text", "tokens": TOKENS[:-1]}]},
    "loss_fn_inputs": {
        "target_tokens": {"data": TOKENS[1:], "dtype": "int64"},
        "weights": {"data": [1.0] * 20, "dtype": "float32"},
    },
}


def result(client: TestClient, headers: dict[str, str], request_id: str) -> dict[str, object]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        body: dict[str, object] = client.post(
            "/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers
        ).json()
        if body.get("type") != "try_again":
            assert "error" not in body, body
            return body
    raise AssertionError("no result")


def op(
    client: TestClient, headers: dict[str, str], path: str, body: dict[str, object]
) -> dict[str, object]:
    response = client.post(f"/api/v1/{path}", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return result(client, headers, str(response.json()["request_id"]))
