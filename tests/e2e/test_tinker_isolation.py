"""Tenants cannot see or touch each other's runs, samplers, checkpoints or futures; bad input
gets a clear error and leaves the run usable."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import tinker
from sqlalchemy import func, select
from tinker import types

from core.tables import Operation
from tests.scenarios import MODEL, sft_datum
from tests.server import LiveServer

pytestmark = pytest.mark.e2e


@dataclass
class Owned:
    run_id: str
    sampler_id: str
    checkpoint: str
    request_id: str


@pytest.fixture(scope="module")
def owner(live_server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Owned]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(tmp_path_factory.mktemp("home")))
        client = tinker.ServiceClient(
            base_url=live_server.base_url, api_key=live_server.make_tenant().key
        )
        trainer = client.create_lora_training_client(base_model=MODEL, rank=4).result()
        trainer.forward_backward([sft_datum(0)], "cross_entropy").result()
        checkpoint = trainer.save_state("private").result().path
        sampler = trainer.save_weights_and_get_sampling_client().result()
        sampler.sample(
            types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2)
        ).result()
        with live_server.database.reader() as db:
            request_id = db.scalar(
                select(Operation.id).where(
                    Operation.target_id == trainer.model_id, Operation.seq_id == 1
                )
            )
        yield Owned(trainer.model_id, sampler._sampling_session_id, checkpoint, request_id)
        client.close("success").result(timeout=60)


@pytest.fixture
def intruder(live_server: LiveServer) -> Iterator[tuple[httpx.Client, str]]:
    key = live_server.make_tenant().key
    with httpx.Client(
        base_url=f"{live_server.base_url}/api/v1", headers={"X-API-Key": key}, timeout=60
    ) as http:
        session_id = http.post("/create_session", json={}).json()["session_id"]
        yield http, session_id


def test_foreign_ids_look_missing(
    owner: Owned, intruder: tuple[httpx.Client, str], live_server: LiveServer
) -> None:
    http, session_id = intruder
    with live_server.database.reader() as db:
        ops_before = db.scalar(select(func.count()).select_from(Operation))
    attempts = {
        "get_info": http.post("/get_info", json={"model_id": owner.run_id}),
        "optim_step": http.post(
            "/optim_step",
            json={"model_id": owner.run_id, "seq_id": 50, "adam_params": {"learning_rate": 1.0}},
        ),
        "save_weights": http.post(
            "/save_weights", json={"model_id": owner.run_id, "path": "stolen", "seq_id": 51}
        ),
        "asample": http.post(
            "/asample",
            json={
                "sampling_session_id": owner.sampler_id,
                "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},
                "sampling_params": {"max_tokens": 1},
            },
        ),
        "sampler": http.get(f"/samplers/{owner.sampler_id}"),
        "sampling from checkpoint": http.post(
            "/create_sampling_session",
            json={
                "session_id": session_id,
                "sampling_session_seq_id": 0,
                "model_path": owner.checkpoint,
            },
        ),
        "load checkpoint": http.post(
            "/load_weights",
            json={
                "session_id": session_id,
                "model_seq_id": 0,
                "path": owner.checkpoint,
                "optimizer": True,
            },
        ),
        "future": http.post("/retrieve_future", json={"request_id": owner.request_id}),
    }
    for name, response in attempts.items():
        assert response.status_code == 404, (name, response.text)
        assert "not found" in response.json()["detail"], name
    with live_server.database.reader() as db:
        assert db.scalar(select(func.count()).select_from(Operation)) == ops_before


def test_bad_input_is_a_user_error_and_the_run_survives(live_server: LiveServer) -> None:
    client = tinker.ServiceClient(
        base_url=live_server.base_url, api_key=live_server.make_tenant().key
    )
    trainer = client.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
    good = [sft_datum(0)]
    baseline = trainer.forward(good, "cross_entropy").result().metrics["loss:sum"]
    bad_batches = {
        "out of vocabulary": (
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints([1, 99999]),
                    loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]},
                )
            ],
            "cross_entropy",
        ),
        "length mismatch": (
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints([1, 2, 3]),
                    loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]},
                )
            ],
            "cross_entropy",
        ),
        "unknown loss": (good, "mystery_loss"),
        "missing input": (good, "importance_sampling"),
    }
    for name, (batch, loss_fn) in bad_batches.items():
        with pytest.raises(tinker.RequestFailedError) as info:
            trainer.forward_backward(batch, loss_fn).result()
        assert info.value.category == "user", name
    # Nothing above touched the adapter or its accumulated gradients.
    assert trainer.forward(good, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
        baseline
    )
    # A step on the failed batches' window is refused (docs/protocol.md); the next one trains.
    with pytest.raises(tinker.RequestFailedError) as info:
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert "optim_step refused" in info.value.message
    trainer.forward_backward(good, "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert trainer.forward(good, "cross_entropy").result().metrics["loss:sum"] < baseline
    client.close("success").result(timeout=60)


def test_malformed_protobuf_is_refused_at_once(owner: Owned, live_server: LiveServer) -> None:
    key = live_server.make_tenant().key
    response = httpx.post(
        f"{live_server.base_url}/api/v1/forward_backward",
        content=b"\x0a\xffgarbage",
        headers={"X-API-Key": key, "Content-Type": "application/x-protobuf"},
    )
    assert response.status_code == 422
    assert "protobuf" in response.json()["detail"]
    assert response.headers["x-should-retry"] == "false"
