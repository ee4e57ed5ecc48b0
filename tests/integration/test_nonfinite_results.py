"""Results holding NaN or infinities travel as JSON: written as "NaN" / "Infinity" /
"-Infinity", read back as floats by the tinker SDK's models and by treadle's alike.

Results are stored the way the worker stores them (`Outcome.json`, the protobuf encoders) and
fetched through `retrieve_future`, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from tinker import types as tinker_types

from core import sessions
from core.clock import FakeClock
from core.db import Database
from core.tables import Operation, OpStatus
from gpu_worker import protocol as ep
from scheduler.convert import forward_backward_output
from scheduler.ops import PROTO, OpKind, encode_json_payload
from scheduler.submit import submit
from scheduler.worker.outcome import Outcome
from tests.builders import TenantKey, tenant_factory
from tests.server import AppFactory
from treadle.types import (
    ForwardBackwardOutput,
    OptimStepResponse,
    SampledSequence,
    SampleResponse,
)
from treadle.wire import (
    PROTOBUF_CONTENT_TYPE,
    decode_forward_backward_output,
    encode_sample_response,
)

pytestmark = pytest.mark.integration


def _strict_json(data: bytes) -> Any:
    """Parse as standard JSON: Python's parser would otherwise accept bare NaN tokens."""

    def refuse(token: str) -> None:
        raise AssertionError(f"{token} is not JSON")

    return json.loads(data, parse_constant=refuse)


@pytest.fixture
def served(
    app_factory: AppFactory, database_url: str
) -> Iterator[tuple[TestClient, TenantKey, str]]:
    clock = FakeClock()
    app = app_factory(database_url, clock=clock, long_poll_seconds=0.1)
    with TestClient(app) as client:
        database = app.state.treadle.database
        tenant = tenant_factory(database, app.state.treadle.settings, clock)()
        with database.transaction() as db:
            session = sessions.create_session(
                db, clock, tenant_id=tenant.tenant_id, api_key_id=None, ttl_seconds=1e6
            )
        yield client, tenant, session.id


def _done_op(
    client: TestClient, tenant: TenantKey, session_id: str, result: bytes, codec: str
) -> str:
    """An operation finished with `result`, as the worker host records one."""
    database: Database = client.app.state.treadle.database  # type: ignore[attr-defined]
    clock = client.app.state.treadle.clock  # type: ignore[attr-defined]
    payload, payload_codec = encode_json_payload({})
    with database.transaction() as db:
        submitted = submit(
            db,
            clock,
            tenant_id=tenant.tenant_id,
            session_id=session_id,
            target_id=f"{session_id}:sample:0",
            seq_id=None,
            kind=OpKind.SAMPLE,
            payload=payload,
            payload_codec=payload_codec,
        )
        op = db.get(Operation, submitted.request_id)
        assert op is not None
        op.status, op.result, op.result_codec = OpStatus.DONE, result, codec
    return submitted.request_id


def _retrieve(
    client: TestClient, tenant: TenantKey, request_id: str, **headers: str
) -> Any:  # the TestClient's response
    response = client.post(
        "/api/v1/retrieve_future",
        json={"request_id": request_id},
        headers={"X-API-Key": tenant.key, **headers},
    )
    assert response.status_code == 200, response.text
    return response


def test_non_finite_json_results_reach_both_sdks_as_floats(
    served: tuple[TestClient, TenantKey, str],
) -> None:
    client, tenant, session_id = served
    metrics = {"grad_norm:mean": math.nan, "loss:max": math.inf, "loss:min": -math.inf}
    stored = Outcome.json(OptimStepResponse(metrics=metrics))
    assert stored.result is not None and stored.codec is not None
    request_id = _done_op(client, tenant, session_id, stored.result, stored.codec)

    body = _strict_json(_retrieve(client, tenant, request_id).content)
    assert body["metrics"] == {
        "grad_norm:mean": "NaN",
        "loss:max": "Infinity",
        "loss:min": "-Infinity",
    }
    for parsed in (
        tinker_types.OptimStepResponse.model_validate(body).metrics,
        OptimStepResponse.model_validate(body).metrics,
    ):
        assert parsed is not None
        assert math.isnan(parsed["grad_norm:mean"])
        assert (parsed["loss:max"], parsed["loss:min"]) == (math.inf, -math.inf)


def test_protobuf_results_asked_for_as_json_keep_their_non_finite_values(
    served: tuple[TestClient, TenantKey, str],
) -> None:
    client, tenant, session_id = served
    logprobs = np.array([math.nan, -math.inf, -0.25, math.inf], dtype=np.float32)
    proto = forward_backward_output(
        ep.ForwardBackwardResult(
            loss_fn_outputs=[{"logprobs": logprobs}],
            metrics={"loss:sum": math.inf},
            usage=ep.Usage(),
        )
    )
    request_id = _done_op(client, tenant, session_id, proto, PROTO)

    as_json = _retrieve(client, tenant, request_id)
    assert as_json.headers["content-type"].startswith("application/json")
    fb = ForwardBackwardOutput.model_validate(_strict_json(as_json.content))
    as_proto = _retrieve(client, tenant, request_id, Accept=PROTOBUF_CONTENT_TYPE)
    expected = decode_forward_backward_output(as_proto.content)
    for output in (fb, expected):
        values = output.loss_fn_outputs[0]["logprobs"].data
        assert math.isnan(values[0]) and values[1:] == [-math.inf, -0.25, math.inf]
        assert output.metrics == {"loss:sum": math.inf}

    sample = encode_sample_response(
        SampleResponse(
            sequences=[
                SampledSequence(stop_reason="length", tokens=[5, 6], logprobs=[-math.inf, -1.5])
            ]
        )
    )
    request_id = _done_op(client, tenant, session_id, sample, PROTO)
    response = _retrieve(client, tenant, request_id, **{"X-Tinker-Request-Type": "Sample"})
    parsed = SampleResponse.model_validate(_strict_json(response.content))
    assert parsed.sequences[0].logprobs == [-math.inf, -1.5]
