"""Every `Raises:` entry of the treadle clients' public methods is the exception raised.

Each documented entry has a trigger here, run against a real embedded server; the few that
cannot be triggered in a test environment are listed with the reason. A new `Raises:` entry
without a trigger fails `test_every_documented_raise_has_a_trigger`.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import treadle
from tests.server import LiveServer
from treadle import types

pytestmark = pytest.mark.e2e

MODEL = "treadle/tiny-1m"
CLIENTS = (
    treadle.ServiceClient,
    treadle.TrainingClient,
    treadle.SamplingClient,
    treadle.RestClient,
)

UNTRIGGERABLE = {
    ("TrainingClient.get_tokenizer", "MissingDependencyError"): "tokenizers is installed",
    ("RestClient.download_checkpoint", "APIConnectionError"): "needs a download cut midway",
    ("RestClient.list_open_sessions", "APIConnectionError"): "covered with a closed port "
    "by the connection tests",
    ("RestClient.end_session", "APIConnectionError"): "covered with a closed port by the "
    "connection tests",
    ("TrainingClient.live_sampling_client", "BadRequestError"): "needs the run's session "
    "ended; covered by tests/e2e/test_live_sampling.py",
    ("ServiceClient.create_sampling_client", "BadRequestError"): "needs a live run whose "
    "session ended; covered by tests/e2e/test_live_sampling.py",
}


def documented_raises() -> set[tuple[str, str]]:
    """(Class.method, exception name) for each `Raises:` entry of the clients' public API."""
    found = set()
    for cls in CLIENTS:
        for name, member in vars(cls).items():
            if name.startswith("_") and name != "__init__":
                continue
            doc = inspect.getdoc(cls if name == "__init__" else member) or ""
            section = re.search(r"^Raises[^\n]*:\n((?:[ \t]+.*\n?)+)", doc, re.MULTILINE)
            if section:
                for error in re.findall(r"^    (\w+):", section.group(1), re.MULTILINE):
                    found.add((f"{cls.__name__}.{name}", error))
    return found


@dataclasses.dataclass
class World:
    server: LiveServer
    key: str
    service: treadle.ServiceClient
    trainer: treadle.TrainingClient
    sampler: treadle.SamplingClient
    rest: treadle.RestClient
    weights: str
    sampler_weights: str

    def missing(self, kind: str = "weights") -> str:
        return f"tinker://{self.trainer.model_id}/{kind}/never-saved"


def datum(**inputs: Any) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs=inputs or {"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4},
    )


@pytest.fixture(scope="module")
def world(live_server: LiveServer) -> Iterator[World]:
    key = live_server.make_tenant(max_lora_rank=8, max_concurrent_sessions=1).key
    with treadle.ServiceClient(base_url=live_server.base_url, api_key=key) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, seed=1)
        weights = trainer.save_state("kept").result(timeout=120).path
        sampler_weights = trainer.save_weights_for_sampler("kept").result(timeout=120).path
        sampler = service.create_sampling_client(base_model=MODEL)
        yield World(
            live_server,
            key,
            service,
            trainer,
            sampler,
            service.create_rest_client(),
            weights,
            sampler_weights,
        )


def _second_session(w: World) -> None:
    other = treadle.ServiceClient(base_url=w.server.base_url, api_key=w.key)
    try:
        other.create_lora_training_client(MODEL, rank=4)
    finally:
        other.close()


def _no_key(w: World) -> None:
    import os

    saved = os.environ.pop("TREADLE_API_KEY", None)
    try:
        treadle.ServiceClient(base_url=w.server.base_url)
    finally:
        if saved is not None:
            os.environ["TREADLE_API_KEY"] = saved


def _custom_loss(data: list[types.Datum], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
    raise AssertionError("never reached: the datum has no target_tokens")


def _damaged_part(w: World) -> None:
    """A `.part` file of the full size but other bytes: the digest check refuses it."""
    import tempfile

    urls = w.rest.get_download_urls(w.weights).result(timeout=60)
    with tempfile.TemporaryDirectory() as folder:
        first = urls.files[0]
        part = Path(folder) / f"{first.path}.part"
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_bytes(b"x" * first.size_bytes)
        w.rest.download_checkpoint(w.weights, folder).result(timeout=60)


def _live_of_missing_run(w: World) -> None:
    """A training client whose run id names no run (as one of another tenant looks)."""
    import copy

    ghost = copy.copy(w.trainer)
    ghost.model_id = f"{w.trainer.model_id}-gone"
    ghost.live_sampling_client()


Trigger = Callable[[World], Any]
LONG_PROMPT = types.ModelInput.from_ints([1] * 5000)

TRIGGERS: dict[tuple[str, str], Trigger] = {
    ("ServiceClient.__init__", "AuthenticationError"): _no_key,
    ("ServiceClient.__init__", "InvalidArgumentError"): lambda w: treadle.ServiceClient(
        base_url=w.server.base_url, api_key=w.key, connect_timeout=-1
    ),
    ("ServiceClient.create_lora_training_client", "InvalidArgumentError"): lambda w: (
        w.service.create_lora_training_client(MODEL, rank="eight")
    ),
    ("ServiceClient.create_lora_training_client", "BadRequestError"): lambda w: (
        w.service.create_lora_training_client("nobody/serves-this", rank=4)
    ),
    ("ServiceClient.create_lora_training_client", "QuotaExceededError"): _second_session,
    ("ServiceClient.create_training_client_from_state", "NotFoundError"): lambda w: (
        w.service.create_training_client_from_state(w.missing())
    ),
    ("ServiceClient.create_training_client_from_state_with_optimizer", "NotFoundError"): (
        lambda w: w.service.create_training_client_from_state_with_optimizer(w.missing())
    ),
    ("ServiceClient.create_training_client_from_state_with_optimizer", "BadRequestError"): (
        lambda w: w.service.create_training_client_from_state_with_optimizer(w.sampler_weights)
    ),
    ("ServiceClient.create_sampling_client", "InvalidArgumentError"): lambda w: (
        w.service.create_sampling_client(model_path="runs/x/sampler_weights/y")
    ),
    ("ServiceClient.create_sampling_client", "NotFoundError"): lambda w: (
        w.service.create_sampling_client(model_path=w.missing("sampler_weights"))
    ),
    ("TrainingClient.forward_backward", "InvalidArgumentError"): lambda w: (
        w.trainer.forward_backward(datum())
    ),
    ("TrainingClient.forward_backward", "RequestRejectedError"): lambda w: (
        w.trainer.forward_backward([datum(target_tokens=[6, 7, 8, 9])]).result(timeout=120)
    ),
    ("TrainingClient.forward_backward_custom", "InvalidArgumentError"): lambda w: (
        w.trainer.forward_backward_custom([datum(weights=[1.0] * 4)], _custom_loss)
    ),
    ("TrainingClient.optim_step", "InvalidArgumentError"): lambda w: w.trainer.optim_step(1e-3),
    ("TrainingClient.save_state", "InvalidArgumentError"): lambda w: w.trainer.save_state(1),
    ("TrainingClient.save_state", "BadRequestError"): lambda w: w.trainer.save_state("kept").result(
        timeout=120
    ),
    ("TrainingClient.load_state", "InvalidArgumentError"): lambda w: w.trainer.load_state(None),
    ("TrainingClient.load_state", "NotFoundError"): lambda w: w.trainer.load_state(
        w.missing()
    ).result(timeout=120),
    ("TrainingClient.load_state", "BadRequestError"): lambda w: w.trainer.load_state("kept").result(
        timeout=120
    ),
    ("TrainingClient.load_state_with_optimizer", "InvalidArgumentError"): lambda w: (
        w.trainer.load_state_with_optimizer(Path("kept"))
    ),
    ("TrainingClient.load_state_with_optimizer", "NotFoundError"): lambda w: (
        w.trainer.load_state_with_optimizer(w.missing()).result(timeout=120)
    ),
    ("TrainingClient.load_state_with_optimizer", "BadRequestError"): lambda w: (
        w.trainer.load_state_with_optimizer(w.sampler_weights).result(timeout=120)
    ),
    ("TrainingClient.save_weights_for_sampler", "InvalidArgumentError"): lambda w: (
        w.trainer.save_weights_for_sampler(2)
    ),
    ("TrainingClient.create_sampling_client", "InvalidArgumentError"): lambda w: (
        w.trainer.create_sampling_client("sampler_weights/kept")
    ),
    ("TrainingClient.live_sampling_client", "NotFoundError"): _live_of_missing_run,
    ("TrainingClient.create_sampling_client", "NotFoundError"): lambda w: (
        w.trainer.create_sampling_client(w.missing("sampler_weights"))
    ),
    ("SamplingClient.sample", "InvalidArgumentError"): lambda w: w.sampler.sample([1, 2]),
    ("SamplingClient.sample", "RequestFailedError"): lambda w: w.sampler.sample(
        LONG_PROMPT, 1
    ).result(timeout=120),
    ("SamplingClient.sample", "BadRequestError"): lambda w: w.sampler.sample(
        types.ModelInput.from_ints([1, 2]), 100_000
    ).result(timeout=120),
    ("SamplingClient.compute_logprobs", "InvalidArgumentError"): lambda w: (
        w.sampler.compute_logprobs([1, 2])
    ),
    ("RestClient.get_training_run", "NotFoundError"): lambda w: w.rest.get_training_run(
        "no-such-run"
    ).result(timeout=60),
    ("RestClient.get_training_run_by_tinker_path", "InvalidArgumentError"): lambda w: (
        w.rest.get_training_run_by_tinker_path("not-a-path")
    ),
    ("RestClient.download_checkpoint", "NotFoundError"): lambda w: w.rest.download_checkpoint(
        w.missing(), Path("never-written")
    ).result(timeout=60),
    ("RestClient.download_checkpoint", "RequestFailedError"): _damaged_part,
    ("RestClient.get_download_urls", "NotFoundError"): lambda w: w.rest.get_download_urls(
        w.missing()
    ).result(timeout=60),
    ("RestClient.get_session", "NotFoundError"): lambda w: w.rest.get_session(
        "no-such-session"
    ).result(timeout=60),
    ("RestClient.list_open_sessions", "AuthenticationError"): lambda w: (
        treadle.RestClient(base_url=w.server.base_url, api_key="tml-000000000000-nope")
        .list_open_sessions()
        .result(timeout=60)
    ),
    ("RestClient.end_session", "NotFoundError"): lambda w: w.rest.end_session(
        "no-such-session"
    ).result(timeout=60),
    ("RestClient.estimate_cost", "BadRequestError"): lambda w: w.rest.estimate_cost(
        "treadle/tiny-1m", {"training": -1}
    ).result(timeout=60),
    ("RestClient.get_package", "NotFoundError"): lambda w: w.rest.get_package(
        "no-such-package"
    ).result(timeout=60),
    # Neither a base model nor a run to take it from.
    ("RestClient.create_package", "BadRequestError"): lambda w: w.rest.create_package(
        "no-base-model"
    ).result(timeout=60),
    ("RestClient.set_alias", "BadRequestError"): lambda w: w.rest.set_alias(
        w.trainer.model_id, "latest", 1
    ).result(timeout=60),
    ("RestClient.delete_version", "BadRequestError"): lambda w: (
        w.rest.set_alias(w.trainer.model_id, "held", 1).result(timeout=60),
        w.rest.delete_version(w.trainer.model_id, 1).result(timeout=60),
    ),
}


def test_every_documented_raise_has_a_trigger() -> None:
    documented = documented_raises()
    assert documented - set(TRIGGERS) - set(UNTRIGGERABLE) == set()
    assert set(TRIGGERS) - documented == set()  # a trigger for a raise no longer documented


@pytest.mark.parametrize("entry", sorted(TRIGGERS), ids=lambda e: f"{e[0]}-{e[1]}")
def test_the_documented_exception_is_raised(world: World, entry: tuple[str, str]) -> None:
    expected = getattr(treadle, entry[1])
    with pytest.raises(expected) as raised:
        TRIGGERS[entry](world)
    assert isinstance(raised.value, treadle.TreadleError), repr(raised.value)
    assert "/api/v1" not in str(raised.value), str(raised.value)


def test_the_same_unknown_checkpoint_raises_the_same_class_on_every_path(world: World) -> None:
    path = world.missing()
    paths: list[Callable[[], Any]] = [
        lambda: world.trainer.load_state(path).result(timeout=120),
        lambda: world.trainer.load_state_with_optimizer(path).result(timeout=120),
        lambda: world.service.create_training_client_from_state(path),
        lambda: world.service.create_training_client_from_state_with_optimizer(path),
    ]
    for call in paths:
        with pytest.raises(treadle.NotFoundError, match="not found") as raised:
            call()
        assert raised.value.status_code == 404
