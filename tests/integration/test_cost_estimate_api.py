"""POST /api/v1/billing/estimate prices usage given by kind at the prices in force now (the
defaults here), per kind and in total, in micro-units and as decimal strings."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.builders import tenant_factory
from tests.server import AppFactory

pytestmark = pytest.mark.integration

MODEL = "treadle/tiny-1m"


@pytest.fixture
def client(app_factory: AppFactory) -> TestClient:
    app = app_factory()
    state = app.state.treadle
    key = tenant_factory(state.database, state.settings)().key
    return TestClient(app, headers={"X-API-Key": key})


def test_each_kind_is_priced_and_summed(client: TestClient) -> None:
    body = client.post(
        "/api/v1/billing/estimate",
        json={
            "base_model": MODEL,
            "usage": {"training": 2_000_000, "sampling_prefill": 1_000_000, "checkpoint": 3},
            "cached_prefill_tokens": 500_000,
        },
    ).json()
    lines = {line["kind"]: line for line in body["lines"]}
    # Defaults: training $0.22 per 1M tokens; prefill $0.07, cached $0.014; checkpoints free.
    assert lines["training"]["amount_micros"] == 440_000
    assert lines["sampling_prefill"]["amount_micros"] == 35_000 + 7_000
    assert lines["sampling_prefill"]["cached_quantity"] == 500_000
    assert lines["checkpoint"]["amount_micros"] == 0
    assert body["total_micros"] == 482_000 and body["total"] == "0.482000"
    assert lines["training"]["amount"] == "0.440000"


@pytest.mark.parametrize(
    ("request_body", "message"),
    [
        ({"base_model": MODEL, "usage": {"gpu_hours": 1}}, "usage kind 'gpu_hours' is unknown"),
        ({"base_model": MODEL, "usage": {"training": -1}}, "pass a quantity of 0 or more"),
        ({"base_model": "nope/none", "usage": {"training": 1}}, "is not served here"),
        (
            {"base_model": MODEL, "usage": {"sampling_prefill": 5}, "cached_prefill_tokens": 6},
            "cached tokens are part of the prefill",
        ),
    ],
)
def test_what_cannot_be_priced_is_refused(
    client: TestClient, request_body: dict[str, object], message: str
) -> None:
    answer = client.post("/api/v1/billing/estimate", json=request_body)
    assert answer.status_code == 422
    assert message in answer.json()["detail"]


def test_the_estimate_needs_a_key(app_factory: AppFactory) -> None:
    answer = TestClient(app_factory()).post(
        "/api/v1/billing/estimate", json={"base_model": MODEL, "usage": {}}
    )
    assert answer.status_code == 401
