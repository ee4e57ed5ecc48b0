"""`APIFuture.usage` from the `X-Treadle-Usage` header: summed over a chunked batch, None when
the server sends no header or a malformed one."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

import treadle
from tests.sdk_client.fake_server import FakeServer
from tests.sdk_client.helpers import FAST, datum
from treadle import types

pytestmark = pytest.mark.unit


def client_with_usage(
    server: FakeServer, header: Callable[[httpx.Request], str | None]
) -> treadle.ServiceClient:
    """A client of `server` whose retrieve_future results carry `header(request)`."""

    def handle(request: httpx.Request) -> httpx.Response:
        response = server.handle(request)
        value = header(request)
        if request.url.path.endswith("/retrieve_future") and value is not None:
            response.headers["X-Treadle-Usage"] = value
        return response

    return treadle.ServiceClient(
        base_url="http://fake",
        api_key="tml-test",
        transport=httpx.MockTransport(handle),
        retry=FAST,
    )


def test_usage_is_summed_over_the_chunks_of_a_batch() -> None:
    server = FakeServer(chunk_len=2)
    with client_with_usage(server, lambda _: '{"training":7}') as service:
        trainer = service.create_lora_training_client("tiny", rank=4)
        fwd = trainer.forward_backward([datum(n) for n in (1, 2, 3, 4, 5)])
        fwd.result(timeout=10)
        single = trainer.forward_backward([datum(2)])
        single.result(timeout=10)
    assert fwd.usage == {"training": 21}  # three requests
    assert single.usage == {"training": 7}
    assert fwd.usage is not fwd.usage  # a copy each time: callers may change it


@pytest.mark.parametrize("header", [None, "not json", '{"training":"7"}', "[1]"])
def test_no_or_malformed_header_leaves_usage_none(header: str | None) -> None:
    server = FakeServer()
    with client_with_usage(server, lambda _: header) as service:
        trainer = service.create_lora_training_client("tiny", rank=4)
        fwd = trainer.forward_backward([datum(3)])
        fwd.result(timeout=10)
        step = trainer.optim_step(types.AdamParams(learning_rate=1e-3))
        step.result(timeout=10)
    assert fwd.usage is None and step.usage is None
