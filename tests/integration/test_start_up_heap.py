"""The API server freezes what start-up built out of the garbage collector's generations once its
engine has started, so full collections in the middle of requests no longer walk torch's and the
app's objects, and thaws them when it stops, so what the app held can be freed."""

from __future__ import annotations

import gc
import time

import pytest
from fastapi.testclient import TestClient

from tests.server import AppFactory

pytestmark = pytest.mark.integration


def test_start_up_is_frozen_once_the_engine_started_and_thawed_when_the_app_stops(
    app_factory: AppFactory,
) -> None:
    app = app_factory()
    with TestClient(app) as client:
        assert app.state.treadle.dispatcher.wait_ready(120), "engine did not start"
        deadline = time.monotonic() + 30
        while gc.get_freeze_count() == 0:
            assert time.monotonic() < deadline, "start-up was never frozen"
            time.sleep(0.05)
        # Requests still allocate (and free) as before.
        assert client.get("/api/v1/healthz").status_code == 200
    assert gc.get_freeze_count() == 0
