"""The malformed-input corpus (tests/corpus) against an embedded server, while another tenant
trains: every broken request gets a 4xx with a bounded message, or — where only the engine can
tell — fails through its future as the caller's error; the other tenant's losses never change.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select

from core.tables import Operation
from tests import corpus
from tests.embedded_app import EmbeddedApp, datum, embedded_app
from treadle.types import ForwardBackwardRequest
from treadle.wire import encode_forward_backward_request

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_REQUEST_BYTES = 2 << 20
# A 4xx body may quote a little of the input, never much of it.
MAX_ERROR_BYTES = 2048
VICTIM_TOKENS = [(11 * i) % 250 + 5 for i in range(25)]
STEPS = 6


def _forward_backward(run_id: str, seq_id: int, forward_only: bool = False) -> dict[str, Any]:
    return {
        "model_id": run_id,
        "seq_id": seq_id,
        "data": [datum(VICTIM_TOKENS)],
        "loss_fn": "cross_entropy",
        "forward_only": forward_only,
    }


def _train(app: EmbeddedApp, headers: dict[str, str], run_id: str, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        out = app.op(headers, "forward_backward", _forward_backward(run_id, 2 * step + 1))
        losses.append(float(out["metrics"]["loss:sum"]))
        app.op(
            headers,
            "optim_step",
            {"model_id": run_id, "seq_id": 2 * step + 2, "adam_params": {"learning_rate": 0.05}},
        )
    return losses


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedApp]:
    with embedded_app(
        tmp_path_factory.mktemp("corpus"),
        raise_server_exceptions=False,
        max_request_bytes=MAX_REQUEST_BYTES,
    ) as served:
        yield served


def _attacker_objects(app: EmbeddedApp, headers: dict[str, str]) -> corpus.Ids:
    session_id = app.session(headers)
    runs = []
    for seq in (0, 1):
        created = app.op(
            headers,
            "create_model",
            {
                "session_id": session_id,
                "model_seq_id": seq,
                "base_model": "treadle/tiny-1m",
                "lora_config": {"rank": 2},
            },
        )
        runs.append(str(created["model_id"]))
    saved_id = app.submit(headers, "save_weights", {"model_id": runs[0], "seq_id": 1, "path": "ck"})
    saved = app.result(headers, saved_id)
    sampler = app.post(
        headers,
        "create_sampling_session",
        {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": "treadle/tiny-1m"},
    ).json()
    return corpus.Ids(
        session_id=session_id,
        run_id=runs[0],
        spare_run_id=runs[1],
        checkpoint_path=str(saved["path"]),
        sampler_id=str(sampler["sampling_session_id"]),
        request_id=saved_id,
    )


def _cases(app: EmbeddedApp, ids: corpus.Ids) -> list[corpus.Case]:
    seq_ids = itertools.count(2)
    cases = [
        case
        for route, body in corpus.valid_bodies(ids, seq_ids).items()
        for case in corpus.json_cases(route, body)
    ]
    cases += corpus.forward_backward_cases(ids.run_id, seq_ids, MAX_REQUEST_BYTES)
    return cases


def test_every_broken_request_is_refused_while_another_tenant_trains(app: EmbeddedApp) -> None:
    victim, reference, attacker = app.tenant(), app.tenant(), app.tenant()
    expected = _train(app, reference, app.run(reference, seed=9), STEPS)
    victim_run = app.run(victim, seed=9)
    ids = _attacker_objects(app, attacker)

    victim_losses: list[float] = []
    failures: list[BaseException] = []

    def train_victim() -> None:
        try:
            victim_losses.extend(_train(app, victim, victim_run, STEPS))
        except BaseException as exc:
            failures.append(exc)

    trainer = threading.Thread(target=train_victim)
    trainer.start()
    accepted: dict[str, str] = {}
    problems: list[str] = []
    for case in _cases(app, ids):
        response = app.client.request(
            case.method,
            corpus.url_of(case.route),
            content=case.body,
            headers={**attacker, **case.headers},
        )
        if response.status_code == 200:
            accepted[response.json().get("request_id", "")] = case.name
        elif not 400 <= response.status_code < 500:
            problems.append(f"{case.name}: {response.status_code} {response.text[:200]}")
        elif len(response.content) > MAX_ERROR_BYTES or corpus.LONG_STRING[:201] in response.text:
            problems.append(f"{case.name}: {len(response.content)}-byte error body")
    trainer.join(timeout=600)
    assert not problems, "\n".join(problems)
    assert not failures, failures
    assert victim_losses == pytest.approx(expected, rel=1e-5)

    # What the API let through either ran or failed as the caller's fault, never the server's.
    accepted.pop("", None)
    with app.database.reader() as db:
        ops = db.scalars(select(Operation).where(Operation.id.in_(list(accepted)))).all()
    server_faults = [
        f"{accepted[op.id]}: {op.error_message}" for op in ops if op.error_category == "server"
    ]
    assert not server_faults, server_faults


def test_poison_ops_batched_with_another_tenants_op_fail_alone(app: EmbeddedApp) -> None:
    """Each poison request, written into the op log beside another tenant's forward pass (so
    that one engine tick claims both, as if the API had let it through), fails as the caller's
    error, and the forward pass beside it gives the same loss every time."""
    victim, attacker = app.tenant(), app.tenant()
    victim_run, attacker_run = app.run(victim, seed=4), app.run(attacker)
    expected = float(
        app.op(victim, "forward_backward", _forward_backward(victim_run, 1, forward_only=True))[
            "metrics"
        ]["loss:sum"]
    )
    victim_seq, attacker_seq = itertools.count(2), itertools.count(1)
    for name, poison in corpus.poison_requests(attacker_run, attacker_seq).items():
        seq_id = next(victim_seq)
        honest = encode_forward_backward_request(
            ForwardBackwardRequest.model_validate(_forward_backward(victim_run, seq_id, True))
        )
        honest_id, poison_id = app.log_together(
            [
                (victim_run, seq_id, honest),
                (attacker_run, poison.seq_id, encode_forward_backward_request(poison)),
            ]
        )
        failed = app.result(attacker, poison_id)
        assert failed.get("category") == "user", (name, failed)
        out = app.result(victim, honest_id)
        assert float(out["metrics"]["loss:sum"]) == pytest.approx(expected, rel=1e-5), name


def test_corpus_covers_every_route_that_takes_a_json_body(app: EmbeddedApp) -> None:
    ids = corpus.Ids("s", "s:train:0", "s:train:1", "tinker://s:train:0/weights/ck", "s:1", "r")
    covered = (
        {corpus.url_of(route) for route in corpus.valid_bodies(ids, itertools.count(1))}
        | {"/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl"}
        | corpus.REGISTRY_TEMPLATES
    )
    document = app.client.get("/openapi.json").json()
    taking_json = {
        path
        for path, operations in document["paths"].items()
        for operation in operations.values()
        if "application/json" in operation.get("requestBody", {}).get("content", {})
    }
    # These take a JSON body that the corpus leaves to the cross-tenant and fuzzing tests.
    elsewhere = {
        "/api/v1/cancel_future",
        "/api/v1/sessions/{session_id}/finish",
    }
    assert taking_json - elsewhere <= covered, sorted(taking_json - elsewhere - covered)
