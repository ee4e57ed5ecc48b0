"""One tenant's poison op never stops another tenant's run.

A poison op is one the engine cannot even lay out (a sparse loss input that would densify to
2**62 entries), or one whose execution brings the whole engine step down. The API refuses the
first kind; ops of either kind that reach a worker anyway (logged before a check existed, or
faulting outside any check) fail alone, while the ops claimed in the same tick run with
exactly the losses they would have had without it — also across a restart.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import zstandard
from sqlalchemy import select

from core.tables import Operation, TrainingRun
from scheduler.ops import OpKind
from scheduler.submit import submit_training_op
from scheduler.worker.claimed import Task
from scheduler.worker.execute import Executor
from tests.embedded_app import EmbeddedApp, datum, embedded_app
from treadle.types import Datum, ForwardBackwardRequest, ModelInput, TensorData
from treadle.wire import encode_forward_backward_request

pytestmark = pytest.mark.integration

TOKENS = [(7 * i) % 200 + 10 for i in range(17)]
N = len(TOKENS) - 1


def _bomb(run_id: str, seq_id: int) -> ForwardBackwardRequest:
    """A 393-byte request whose weights describe a [N, 2**62] sparse tensor."""
    return ForwardBackwardRequest(
        model_id=run_id,
        seq_id=seq_id,
        loss_fn="cross_entropy",
        data=[
            Datum(
                model_input=ModelInput.from_ints(TOKENS[:-1]),
                loss_fn_inputs={
                    "target_tokens": TensorData(data=TOKENS[1:], dtype="int64"),
                    "weights": TensorData(
                        data=[],
                        dtype="float32",
                        shape=[N, 2**62],
                        sparse_crow_indices=[0] * (N + 1),
                        sparse_col_indices=[],
                    ),
                },
            )
        ],
    )


def _fb(run_id: str, seq_id: int) -> dict[str, Any]:
    return {
        "model_id": run_id,
        "seq_id": seq_id,
        "data": [datum(TOKENS)],
        "loss_fn": "cross_entropy",
    }


def _loss(result: dict[str, Any]) -> float:
    assert "error" not in result, result
    return float(result["metrics"]["loss:sum"])


def _train_step(app: EmbeddedApp, headers: dict[str, str], run_id: str, seq_id: int) -> float:
    """forward_backward + optim_step at seq_id, seq_id + 1; returns the loss."""
    loss = _loss(app.result(headers, app.submit(headers, "forward_backward", _fb(run_id, seq_id))))
    app.op(
        headers,
        "optim_step",
        {"model_id": run_id, "seq_id": seq_id + 1, "adam_params": {"learning_rate": 0.05}},
    )
    return loss


def _step_refused(app: EmbeddedApp, headers: dict[str, str], run_id: str, seq_id: int) -> None:
    """An optim_step at seq_id after a failed forward_backward fails, as docs/protocol.md says;
    the run's next window starts afresh."""
    body = {"model_id": run_id, "seq_id": seq_id, "adam_params": {"learning_rate": 0.05}}
    refused = app.result(headers, app.submit(headers, "optim_step", body))
    assert refused["category"] == "user" and "optim_step refused" in refused["error"], refused


@dataclasses.dataclass
class Tenants:
    """A victim, a reference that trains the same run undisturbed, and an attacker."""

    victim: dict[str, str]
    reference: dict[str, str]
    attacker: dict[str, str]
    victim_run: str
    reference_run: str
    attacker_run: str

    @classmethod
    def of(cls, app: EmbeddedApp) -> Tenants:
        victim, reference, attacker = app.tenant(), app.tenant(), app.tenant()
        return cls(
            victim,
            reference,
            attacker,
            app.run(victim, seed=5),
            app.run(reference, seed=5),
            app.run(attacker),
        )

    def crash_together(self, app: EmbeddedApp, monkeypatch: pytest.MonkeyPatch) -> list[str]:
        """Log seq 1 of the victim and of the attacker for one tick, where every engine step
        holding the attacker's op fails as a whole; returns (victim's, attacker's) request ids."""
        _crash_on(self.attacker_run, monkeypatch)
        return app.log_together(
            [
                (self.victim_run, 1, _honest(self.victim_run, 1)),
                (self.attacker_run, 1, _honest(self.attacker_run, 1)),
            ]
        )

    def expected(self, app: EmbeddedApp, *seq_ids: int) -> list[float]:
        """The reference's losses for train steps at these seq ids."""
        return [_train_step(app, self.reference, self.reference_run, seq) for seq in seq_ids]


def _proto(request: ForwardBackwardRequest) -> bytes:
    return encode_forward_backward_request(request)


def _honest(run_id: str, seq_id: int) -> bytes:
    return _proto(ForwardBackwardRequest.model_validate(_fb(run_id, seq_id)))


def _ops(app: EmbeddedApp) -> dict[str, Operation]:
    with app.database.reader() as db:
        return {op.id: op for op in db.scalars(select(Operation))}


def test_the_api_keeps_the_bomb_out_of_the_engine_and_the_run_in_order(tmp_path: Path) -> None:
    """The API checks loss-input shapes: the bomb's body is never logged; its seq_id is queued
    as a refusal, so it fails in the run's order and the next request never waits for it."""
    with embedded_app(tmp_path, gap_timeout_seconds=3600) as app:
        headers = app.tenant()
        run_id = app.run(headers)
        for content_type, body in (
            ("application/x-protobuf", _proto(_bomb(run_id, 1))),
            ("application/json", _bomb(run_id, 2).model_dump_json().encode()),
        ):
            response = app.client.post(
                "/api/v1/forward_backward",
                content=body,
                headers={**headers, "Content-Type": content_type},
            )
            assert response.status_code == 200, response.text
            failed = app.result(headers, response.json()["request_id"])
            assert failed["category"] == "user", failed
            assert "weights" in failed["error"] and "[1, 1024]" in failed["error"], failed
            stored = _ops(app)[response.json()["request_id"]]
            assert stored.payload_codec == "json+zstd"  # the refusal, not the body
        _step_refused(app, headers, run_id, 3)
        _train_step(app, headers, run_id, 4)


@pytest.mark.parametrize(
    ("weights", "complaint"),
    [
        ({"data": [1.0] * (N + 1), "dtype": "float32"}, f"N={N} tokens"),
        ({"data": [1.0] * N, "dtype": "float32", "shape": [N, 1, 1]}, "(N,) or (N, K)"),
        ({"data": [], "dtype": "float32", "shape": [N, 0]}, "[1, 1024]"),
        (
            {
                "data": [],
                "dtype": "float32",
                "shape": [N, 1 << 20],
                "sparse_crow_indices": [0] * (N + 1),
                "sparse_col_indices": [],
            },
            "[1, 1024]",
        ),
    ],
)
def test_loss_inputs_that_do_not_fit_their_datum_fail_as_user_errors(
    tmp_path: Path, weights: dict[str, Any], complaint: str
) -> None:
    with embedded_app(tmp_path) as app:
        headers = app.tenant()
        run_id = app.run(headers)
        body = _fb(run_id, 1)
        body["data"][0]["loss_fn_inputs"]["weights"] = weights
        failed = app.result(headers, app.submit(headers, "forward_backward", body))
        assert failed["category"] == "user" and complaint in failed["error"], failed


def test_a_request_refused_at_validation_keeps_its_place(tmp_path: Path) -> None:
    """An out-of-range learning rate answers 422 at once, and the run's next request runs
    without waiting out the gap timeout."""
    with embedded_app(tmp_path, gap_timeout_seconds=3600) as app:
        headers = app.tenant()
        run_id = app.run(headers)
        app.op(headers, "forward_backward", _fb(run_id, 1))
        response = app.post(
            headers,
            "optim_step",
            {"model_id": run_id, "seq_id": 2, "adam_params": {"learning_rate": 1e308}},
        )
        assert response.status_code == 422, response.text
        assert "learning_rate" in response.json()["detail"]
        _train_step(app, headers, run_id, 3)
        refusal = [op for op in _ops(app).values() if op.seq_id == 2]
        assert [(op.status, op.error_category) for op in refusal] == [("failed", "user")]


def test_poison_op_fails_alone_and_its_batch_mates_train_unchanged(tmp_path: Path) -> None:
    with embedded_app(tmp_path) as app:
        t = Tenants.of(app)
        victim, attacker, victim_run, attacker_run = (
            t.victim,
            t.attacker,
            t.victim_run,
            t.attacker_run,
        )
        expected = t.expected(app, 1, 3)

        honest, poison = app.log_together(
            [
                (victim_run, 1, _honest(victim_run, 1)),
                (attacker_run, 1, _proto(_bomb(attacker_run, 1))),
            ],
        )
        failed = app.result(attacker, poison)
        assert failed["category"] == "user" and "[1, 1024]" in failed["error"], failed
        assert _loss(app.result(victim, honest)) == pytest.approx(expected[0], rel=1e-5)
        app.op(
            victim,
            "optim_step",
            {"model_id": victim_run, "seq_id": 2, "adam_params": {"learning_rate": 0.05}},
        )
        assert _train_step(app, victim, victim_run, 3) == pytest.approx(expected[1], rel=1e-5)
        # The attacker's own run goes on too.
        _step_refused(app, attacker, attacker_run, 2)
        _train_step(app, attacker, attacker_run, 3)


def _crash_on(run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every engine step that holds an op of this run fail as a whole, outside any op's
    guard (as a fault in the engine or the host would)."""
    original = Executor.forward_backward

    def forward_backward(self: Executor, tasks: list[Task]) -> Any:
        if any(task.target_id == run_id for task in tasks):
            raise RuntimeError("the engine step crashed")
        return original(self, tasks)

    monkeypatch.setattr(Executor, "forward_backward", forward_backward)


def test_a_step_that_fails_as_a_whole_releases_its_ops_and_gives_up_on_the_culprit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with embedded_app(tmp_path) as app:
        t = Tenants.of(app)
        victim, attacker, victim_run, attacker_run = (
            t.victim,
            t.attacker,
            t.victim_run,
            t.attacker_run,
        )
        [expected] = t.expected(app, 1)

        honest, poison = t.crash_together(app, monkeypatch)

        failed = app.result(attacker, poison)
        assert failed["category"] == "server" and "interrupted 3 times" in failed["error"], failed
        assert _loss(app.result(victim, honest)) == pytest.approx(expected, rel=1e-5)
        ops = _ops(app)
        assert ops[poison].attempts == 3
        assert ops[honest].attempts == 2  # once with the culprit, then alone
        assert not [op for op in ops.values() if op.status == "running"]
        # Both runs go on: the given-up op took its place in the attacker's order.
        monkeypatch.undo()
        app.op(
            victim,
            "optim_step",
            {"model_id": victim_run, "seq_id": 2, "adam_params": {"learning_rate": 0.05}},
        )
        _step_refused(app, attacker, attacker_run, 2)
        _train_step(app, attacker, attacker_run, 3)


def test_ops_left_running_by_a_crash_are_retried_alone_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with embedded_app(tmp_path) as app:
        t = Tenants.of(app)
        victim, attacker, victim_run, attacker_run = (
            t.victim,
            t.attacker,
            t.victim_run,
            t.attacker_run,
        )
        expected = t.expected(app, 1, 3)
        honest, poison = t.crash_together(app, monkeypatch)
        app.result(attacker, poison)
    # As if the process had died while both were claimed in one step: they stay running under
    # the worker's id, one attempt used.
    with app.database.transaction() as db:
        for op in db.scalars(select(Operation).where(Operation.id.in_((honest, poison)))):
            op.status, op.attempts, op.worker_id = "running", 1, "embedded"
            op.result = op.error_message = op.error_category = op.finished_at = None
        for run_id in (victim_run, attacker_run):
            run = db.get(TrainingRun, run_id)
            assert run is not None
            run.executed_seq_id = 0

    with embedded_app(tmp_path) as restarted:  # a new engine, holding no runs
        assert restarted.result(attacker, poison)["category"] == "server"
        assert _loss(restarted.result(victim, honest)) == pytest.approx(expected[0], rel=1e-5)
        restarted.op(
            victim,
            "optim_step",
            {"model_id": victim_run, "seq_id": 2, "adam_params": {"learning_rate": 0.05}},
        )
        assert _train_step(restarted, victim, victim_run, 3) == pytest.approx(expected[1], rel=1e-5)
        assert not [op for op in _ops(restarted).values() if op.status == "running"]


def test_a_compression_bomb_is_refused_while_it_expands(tmp_path: Path) -> None:
    """2 kB of zstd that would expand to 70 MB, past the default 64 MiB limit."""
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\x00" * (70 << 20))
    assert len(bomb) < 4096
    with embedded_app(tmp_path) as app:
        headers = app.tenant()
        run_id = app.run(headers)
        before = len(_ops(app))
        for encoding in ("zstd", None):  # zstd is recognised by its magic number too
            response = app.client.post(
                "/api/v1/forward_backward",
                content=bomb,
                headers={
                    **headers,
                    "Content-Type": "application/x-protobuf",
                    **({"Content-Encoding": encoding} if encoding else {}),
                },
            )
            assert response.status_code == 413, response.text
            assert "split the batch" in response.json()["detail"]
        assert len(_ops(app)) == before
        _train_step(app, headers, run_id, 1)


def test_the_worker_holds_logged_bodies_to_the_request_limit(tmp_path: Path) -> None:
    """A body logged when the limit was higher expands no further than today's limit."""
    with embedded_app(tmp_path, max_request_bytes=1 << 20) as app:
        headers = app.tenant()
        run_id = app.run(headers)
        bomb = zstandard.ZstdCompressor().compress(_honest(run_id, 1) + b"\x00" * (2 << 20))
        with app.database.transaction() as db:
            run = db.get(TrainingRun, run_id)
            assert run is not None
            request_id = submit_training_op(
                db,
                app.state.clock,
                run=run,
                seq_id=1,
                kind=OpKind.FORWARD_BACKWARD,
                payload=bomb,
                payload_codec="proto+zstd",  # a zstd body is stored as sent
            ).request_id
        app.state.dispatcher.wake()
        failed = app.result(headers, request_id)
        assert failed["category"] == "user" and "exceeds" in failed["error"], failed
        _step_refused(app, headers, run_id, 2)
        _train_step(app, headers, run_id, 3)
