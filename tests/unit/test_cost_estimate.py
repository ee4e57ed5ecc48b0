"""Estimates of an op's usage from its request, before it runs: the quantities each kind of
request can use at most, the token count read from a protobuf body without decoding its
values, and money as the spend-limit messages write it."""

from __future__ import annotations

import pytest

from billing import estimate
from billing.ledger import UsageLine
from billing.limits import dollars
from scheduler import fb_proto
from tests.scheduling import forward_backward_request
from treadle.wire import encode_forward_backward_request, parse_forward_backward_request

pytestmark = pytest.mark.unit


def test_training_is_the_tokens_of_the_model_inputs() -> None:
    assert estimate.training(300) == (UsageLine("training", 300),)
    assert estimate.training(0) == ()


def test_a_sample_prefills_its_prompt_once_and_generates_up_to_max_tokens_each() -> None:
    assert estimate.sample(prompt_tokens=40, max_tokens=16, num_samples=4) == (
        UsageLine("sampling_prefill", 40),
        UsageLine("sampling_sample", 64),
    )
    # compute_logprobs: a sample of one token.
    assert estimate.sample(prompt_tokens=40, max_tokens=1, num_samples=1) == (
        UsageLine("sampling_prefill", 40),
        UsageLine("sampling_sample", 1),
    )


def test_a_save_is_one_checkpoint() -> None:
    assert estimate.checkpoint() == (UsageLine("checkpoint", 1),)


def test_the_protobuf_token_count_is_the_model_inputs_length() -> None:
    request = forward_backward_request("s:train:0", 1, list(range(31)))
    request.data.append(request.data[0])
    body = encode_forward_backward_request(request)
    message = parse_forward_backward_request(body, None, max_body_bytes=len(body))
    assert fb_proto.check_request_shapes(message) == 60
    assert sum(datum.model_input.length for datum in request.data) == 60


@pytest.mark.parametrize(
    ("micros", "text"),
    [
        (0, "$0.00"),
        (250, "$0.00025"),
        (1_500_000, "$1.50"),
        (12_345_678_901, "$12,345.678901"),
        (-10_000, "-$0.01"),
    ],
)
def test_dollars_keep_every_micro_unit(micros: int, text: str) -> None:
    assert dollars(micros) == text
