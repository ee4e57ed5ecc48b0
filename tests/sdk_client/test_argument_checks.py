"""Wrong arguments raise at the call, as one `TreadleError` family, naming what was expected."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import treadle
from tests.sdk_client.fake_server import FakeServer
from treadle import types
from treadle._http import RetryPolicy

pytestmark = pytest.mark.unit

FAST = RetryPolicy(initial_backoff_seconds=0.001, max_backoff_seconds=0.01, max_elapsed_seconds=5)


def _datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )


@pytest.fixture
def server() -> FakeServer:
    return FakeServer()


@pytest.fixture
def service(server: FakeServer) -> Iterator[treadle.ServiceClient]:
    with treadle.ServiceClient(
        base_url="http://fake", api_key="tml-x", transport=server.transport(), retry=FAST
    ) as client:
        yield client


Call = Callable[[treadle.ServiceClient, treadle.TrainingClient, treadle.SamplingClient], Any]

CASES: list[tuple[str, Call, str]] = [
    (
        "optim_step",
        lambda s, t, p: t.optim_step(1e-3),
        "optim_step: adam_params expected AdamParams, got float",
    ),
    (
        "forward_backward data",
        lambda s, t, p: t.forward_backward(_datum()),
        "forward_backward: data expected a list of Datum, got Datum",
    ),
    (
        "forward_backward item",
        lambda s, t, p: t.forward_backward([_datum(), {"model_input": [1]}]),
        "forward_backward: data[1] expected Datum, got dict",
    ),
    (
        "forward loss_fn",
        lambda s, t, p: t.forward([_datum()], 3),
        "forward: loss_fn expected str, got int",
    ),
    (
        "forward_backward_custom",
        lambda s, t, p: t.forward_backward_custom([_datum()], "cross_entropy"),
        "forward_backward_custom: loss_fn expected a function, got str",
    ),
    ("save_state", lambda s, t, p: t.save_state(7), "save_state: name expected str, got int"),
    ("load_state", lambda s, t, p: t.load_state(None), "load_state: path expected str"),
    (
        "save_weights_for_sampler",
        lambda s, t, p: t.save_weights_for_sampler(b"x"),
        "save_weights_for_sampler: name expected str, got bytes",
    ),
    (
        "sample prompt",
        lambda s, t, p: p.sample([1, 2, 3]),
        "sample: prompt expected ModelInput, got list",
    ),
    (
        "sample params",
        lambda s, t, p: p.sample(types.ModelInput.from_ints([1]), 1, {"max_tokens": 3}),
        "sample: sampling_params expected SamplingParams, got dict",
    ),
    (
        "sample count",
        lambda s, t, p: p.sample(types.ModelInput.from_ints([1]), True),
        "sample: num_samples expected int, got bool",
    ),
    (
        "compute_logprobs",
        lambda s, t, p: p.compute_logprobs("hello"),
        "compute_logprobs: prompt expected ModelInput, got str",
    ),
    (
        "create_lora_training_client base_model",
        lambda s, t, p: s.create_lora_training_client(42),
        "create_lora_training_client: base_model expected str, got int",
    ),
    (
        "create_lora_training_client rank",
        lambda s, t, p: s.create_lora_training_client("tiny", rank=8.5),
        "create_lora_training_client: rank: Input should be a valid integer",
    ),
    (
        "create_training_client_from_state",
        lambda s, t, p: s.create_training_client_from_state(3),
        "create_training_client_from_state: path expected str, got int",
    ),
    (
        "create_sampling_client",
        lambda s, t, p: s.create_sampling_client(model_path="runs/x/sampler_weights/y"),
        "is neither a tinker:// path",
    ),
    (
        "create_sampling_client neither",
        lambda s, t, p: s.create_sampling_client(),
        "pass exactly one of base_model",
    ),
]


@pytest.mark.parametrize(
    ("call", "message"), [(c, m) for _, c, m in CASES], ids=[n for n, *_ in CASES]
)
def test_a_wrong_argument_raises_at_the_call(
    service: treadle.ServiceClient, server: FakeServer, call: Call, message: str
) -> None:
    trainer = service.create_lora_training_client("tiny", rank=4)
    sampler = service.create_sampling_client(base_model="tiny")
    ops_before = len(server.ops)
    with pytest.raises(treadle.InvalidArgumentError, match=re.escape(message)) as raised:
        call(service, trainer, sampler)
    assert isinstance(raised.value, treadle.TreadleError)
    assert len(server.ops) == ops_before  # nothing was sent


def test_invalid_argument_error_is_also_a_type_and_value_error() -> None:
    # Code written against `except TypeError` / `except ValueError` keeps working.
    assert issubclass(treadle.InvalidArgumentError, TypeError)
    assert issubclass(treadle.InvalidArgumentError, ValueError)
    with pytest.raises(treadle.InvalidArgumentError, match="is not a checkpoint path"):
        types.CheckpointPath.parse("tinker://run/nope")


def test_a_closed_client_raises_client_closed_error(server: FakeServer) -> None:
    service = treadle.ServiceClient(
        base_url="http://fake", api_key="tml-x", transport=server.transport(), retry=FAST
    )
    trainer = service.create_lora_training_client("tiny", rank=4)
    service.close()
    with pytest.raises(treadle.ClientClosedError, match="closed; create a new ServiceClient"):
        trainer.forward_backward([_datum()])
    with pytest.raises(treadle.ClientClosedError):
        service.create_sampling_client(base_model="tiny")
    assert issubclass(treadle.ClientClosedError, treadle.TreadleError)
    assert issubclass(treadle.ClientClosedError, RuntimeError)


@pytest.mark.parametrize(
    ("message", "category", "code", "expected", "also"),
    [
        (
            "checkpoint tinker://r/weights/x not found; list yours",
            "user",
            "not_found",
            treadle.RequestNotFoundError,
            treadle.NotFoundError,
        ),
        (
            "datum 0 lacks weights; add them",
            "user",
            "invalid_input",
            treadle.RequestRejectedError,
            treadle.BadRequestError,
        ),
        (
            "the worker ran out of memory",
            "server",
            "internal_error",
            treadle.RequestFailedError,
            treadle.TreadleError,
        ),
    ],
)
def test_failed_operations_share_the_class_of_the_same_refusal_at_submission(
    message: str, category: str, code: str, expected: type, also: type
) -> None:
    from treadle.errors import error_from_failed_request

    error = error_from_failed_request(message, category, "req-1", code)
    assert type(error) is expected
    assert isinstance(error, also)
    assert isinstance(error, treadle.RequestFailedError)
    assert error.message == message and error.category == category and error.request_id == "req-1"
    assert error.code == code
    if isinstance(error, treadle.APIStatusError):
        assert error.status_code == (404 if also is treadle.NotFoundError else 422)
