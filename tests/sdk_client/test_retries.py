"""Transient failures are retried, permanent ones are not, and no op ever runs twice.

The client talks to `FakeServer` through an httpx MockTransport that injects 503s, refused
connections and connections dropped after the server recorded the op. Resubmissions carry
the same seq id, so the server's dedupe returns the original request and each op runs once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

import treadle
from tests.sdk_client.fake_server import FakeServer
from tests.sdk_client.helpers import FAST, datum
from treadle import types
from treadle._http import HttpClient, RetryPolicy, retry_after_seconds

pytestmark = pytest.mark.unit


def client_for(server: FakeServer, retry: RetryPolicy = FAST) -> treadle.ServiceClient:
    return treadle.ServiceClient(
        base_url="http://fake", api_key="tml-test", transport=server.transport(), retry=retry
    )


@pytest.fixture
def server() -> FakeServer:
    return FakeServer()


@pytest.fixture
def service(server: FakeServer) -> Iterator[treadle.ServiceClient]:
    with client_for(server) as client:
        yield client


def test_transient_failures_are_retried_on_the_same_seq_id(
    server: FakeServer, service: treadle.ServiceClient
) -> None:
    server.faults = {
        "/forward_backward": ["503", "reset-after", "connect"],
        "/optim_step": ["reset-after", "503"],
        "/retrieve_future": ["503", "connect", "reset-after"],
        "/create_model": ["reset-after"],
    }
    trainer = service.create_lora_training_client("tiny", rank=4)
    futures = []
    for _ in range(3):
        futures.append(trainer.forward_backward([datum()]))
        futures.append(trainer.optim_step(types.AdamParams()))
    for future in futures:
        future.result(timeout=10)
    assert server.executed_seq_ids(trainer.model_id) == [0, 1, 2, 3, 4, 5, 6]
    # The dropped answers were resubmitted with the seq id they first carried.
    resent = [
        seq for seq in {s for _, s in server.posts} if [s2 for _, s2 in server.posts].count(seq) > 1
    ]
    assert sorted(resent) == [0, 1, 2]


def test_submissions_leave_in_call_order(
    server: FakeServer, service: treadle.ServiceClient
) -> None:
    server.faults = {"/forward_backward": ["503", "503", "503"]}  # the first submission is slow
    trainer = service.create_lora_training_client("tiny", rank=4)
    fb = trainer.forward_backward([datum()])
    step = trainer.optim_step()
    fb2 = trainer.forward([datum()])
    for future in (fb, step, fb2):
        future.result(timeout=10)
    first_posts = []
    for path, seq in server.posts:
        if seq not in first_posts and path != "/create_model":
            first_posts.append(seq)
    assert first_posts == [1, 2, 3]


def test_large_batches_are_chunked_and_merged() -> None:
    server = FakeServer(chunk_len=2)
    with client_for(server) as service:
        trainer = service.create_lora_training_client("tiny", rank=4)
        out = trainer.forward_backward([datum(n) for n in (1, 2, 3, 4, 5)]).result(timeout=10)
        step = trainer.optim_step().result(timeout=10)
    assert [len(o["logprobs"].data) for o in out.loss_fn_outputs] == [1, 2, 3, 4, 5]
    assert out.metrics["loss:sum"] == 5.0  # 2 + 2 + 1, summed
    # tokens:mean is the seq id per chunk here: weighted by datums (2, 2, 1).
    assert out.metrics["tokens:mean"] == pytest.approx((1 * 2 + 2 * 2 + 3 * 1) / 5)
    assert server.executed_seq_ids(trainer.model_id) == [0, 1, 2, 3, 4]
    assert step.metrics == {"grad_norm:mean": 1.0}


def test_permanent_errors_are_not_retried(server: FakeServer) -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(
            422,
            json={"detail": "lora rank 512 exceeds 64; pass rank ≤ 64", "category": "user"},
            headers={"x-should-retry": "false"},
        )

    with (
        treadle.ServiceClient(
            base_url="http://fake",
            api_key="tml-x",
            transport=httpx.MockTransport(handler),
            retry=FAST,
        ) as service,
        pytest.raises(treadle.BadRequestError, match="pass rank ≤ 64") as info,
    ):
        service.get_server_capabilities()
    assert calls == 1 and info.value.status_code == 422 and info.value.category == "user"


def test_retries_stop_when_the_budget_runs_out() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"detail": "down for maintenance"})

    policy = RetryPolicy(max_attempts=3, initial_backoff_seconds=0.001)
    with (
        treadle.ServiceClient(
            base_url="http://fake",
            api_key="tml-x",
            transport=httpx.MockTransport(handler),
            retry=policy,
        ) as service,
        pytest.raises(treadle.InternalServerError, match="down for maintenance"),
    ):
        service.get_server_capabilities()


def test_non_idempotent_requests_are_not_resent_after_a_dropped_answer() -> None:
    asyncio.run(_non_idempotent())


async def _non_idempotent() -> None:
    sent = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal sent
        sent += 1
        raise httpx.ReadError("dropped", request=request)

    http = HttpClient("http://fake", "tml-x", retry=FAST, transport=httpx.MockTransport(handler))
    with pytest.raises(treadle.APIConnectionError):
        await http.request("POST", "/api/v1/create_session", json={}, idempotent=False)
    assert sent == 1
    sent = 0
    with pytest.raises(treadle.APIConnectionError):
        await http.request("POST", "/api/v1/optim_step", json={})
    assert sent > 1
    await http.aclose()


def test_retry_after_is_honoured() -> None:
    assert retry_after_seconds(httpx.Response(429, headers={"retry-after": "2"})) == 2.0
    assert retry_after_seconds(httpx.Response(429, headers={"retry-after-ms": "250"})) == 0.25
    assert retry_after_seconds(httpx.Response(429, headers={"retry-after": "3600"})) is None
    assert retry_after_seconds(httpx.Response(429)) is None


def test_session_heartbeats_and_finish(server: FakeServer) -> None:
    from treadle._session import Session

    service = client_for(server)
    service._session = Session(service._conn, heartbeat_interval=0.01)
    service.create_lora_training_client("tiny", rank=4)
    deadline = time.monotonic() + 5
    while server.heartbeats < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    service.close()
    assert server.heartbeats >= 2 and server.finished == ["s1"]
    service.close()  # idempotent


def test_close_survives_an_unreachable_server(
    server: FakeServer, caplog: pytest.LogCaptureFixture
) -> None:
    service = client_for(server)
    service.create_lora_training_client("tiny", rank=4)
    server.faults["/sessions/s1/finish"] = ["connect"] * 1000
    service.close()
    assert "could not finish session s1" in caplog.text
