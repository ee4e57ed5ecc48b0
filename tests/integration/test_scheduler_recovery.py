"""Restoring a training run onto an engine that does not hold it, called directly on each
database: the latest snapshot, then exactly the ops executed after it, to the same weights."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from core import runs
from core.tables import TrainingRun, Worker
from scheduler import convert, oplog, retention, workers
from scheduler.ops import OpKind
from scheduler.worker.claimed import Task
from scheduler.worker.execute import Executor
from scheduler.worker.host import WorkerHost
from scheduler.worker.recovery import RestoreImpossible, restore_run
from tests.builders import make_settings
from tests.scheduling import (
    MODEL,
    Rows,
    cpu_engine,
    forward_backward_payload,
    forward_backward_request,
    migrated,
    worker_host,
)

if TYPE_CHECKING:
    from gpu_worker.engine import Engine

pytestmark = pytest.mark.integration

TOKENS = [(5 * i) % 300 + 10 for i in range(21)]
STEPS = 3
RETENTION = timedelta(days=7)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """The engine the runs were trained on."""
    return cpu_engine(tmp_path_factory.mktemp("engine"))


@pytest.fixture
def rows(database_url: str) -> Rows:
    return Rows(migrated(database_url))


@pytest.fixture
def replayed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[OpKind, int | None]]:
    """(kind, seq_id) of each op recovery replays, in order; replay itself runs unchanged."""
    seen: list[tuple[OpKind, int | None]] = []
    original = Executor.replay

    def replay(self: Executor, task: Task) -> None:
        seen.append((task.kind, task.seq_id))
        original(self, task)

    monkeypatch.setattr(Executor, "replay", replay)
    return seen


def _trained(rows: Rows, host: WorkerHost) -> str:
    """A run trained STEPS steps (forward_backward, optim_step) on the host; its seq 7 queued."""
    run = _stepped(rows, host)
    # Queued, never executed: not part of the run's state, so never replayed.
    rows.training_op(run, 2 * STEPS + 1)
    return run


def _stepped(rows: Rows, host: WorkerHost) -> str:
    """A run trained STEPS steps on the host, nothing queued."""
    run = rows.run(rows.tenant(), rank=4, seed=3)
    for step in range(STEPS):
        fb, optim = 2 * step + 1, 2 * step + 2
        rows.training_op(
            run, fb, OpKind.FORWARD_BACKWARD, forward_backward_payload(run, fb, TOKENS)
        )
        rows.training_op(run, optim)
        rows.clock.advance(1)
    assert host.drain() == 1 + 2 * STEPS
    assert {op.status for op in rows.ops(run)} == {"done"}
    return run


def _loss(engine: Engine, run_id: str) -> float:
    from tests.gpu_worker.helpers import forward

    request = forward_backward_request(run_id, 0, TOKENS, forward_only=True)
    return forward(engine, run_id, convert.datums(request)).metrics["loss:sum"]


def _restore(rows: Rows, host: WorkerHost, tmp_path: Path, run_id: str) -> Engine:
    """The run restored onto a fresh engine, as a worker that does not hold it restores it."""
    fresh = cpu_engine(tmp_path / "fresh")
    assert run_id not in fresh.run_ids()
    executor = Executor(fresh, host.store, rows.database, rows.clock)
    restore_run(fresh, host.store, rows.database, executor, run_id)
    assert run_id in fresh.run_ids()
    return fresh


def test_a_run_restored_from_its_snapshot_replays_exactly_the_ops_after_it(
    rows: Rows,
    engine: Engine,
    tmp_path: Path,
    replayed: list[tuple[OpKind, int | None]],
) -> None:
    host = worker_host(rows.database, rows.clock, engine, tmp_path / "art", snapshot_every_steps=2)
    host.register([MODEL], host.store)
    run = _trained(rows, host)
    saved = rows.training_run(run)
    assert (saved.snapshot_seq_id, saved.executed_seq_id) == (4, 2 * STEPS)
    replayed.clear()
    fresh = _restore(rows, host, tmp_path, run)
    assert replayed == [(OpKind.FORWARD_BACKWARD, 5), (OpKind.OPTIM_STEP, 6)]
    assert _loss(fresh, run) == pytest.approx(_loss(engine, run), rel=1e-6)
    # The replayed step matters: the snapshot alone holds the weights of two steps, not three.
    snapshot_only = cpu_engine(tmp_path / "snapshot-only")
    assert saved.snapshot_uri is not None
    snapshot_only.load_state(run, host.store.open_dir(saved.snapshot_uri), include_optimizer=True)
    assert _loss(snapshot_only, run) != pytest.approx(_loss(engine, run), rel=1e-6)


def test_a_run_without_a_snapshot_replays_from_its_creation(
    rows: Rows,
    engine: Engine,
    tmp_path: Path,
    replayed: list[tuple[OpKind, int | None]],
) -> None:
    host = worker_host(
        rows.database, rows.clock, engine, tmp_path / "art", snapshot_every_steps=1000
    )
    host.register([MODEL], host.store)
    run = _trained(rows, host)
    assert rows.training_run(run).snapshot_uri is None
    replayed.clear()
    fresh = _restore(rows, host, tmp_path, run)
    kinds = [OpKind.CREATE_MODEL] + [OpKind.FORWARD_BACKWARD, OpKind.OPTIM_STEP] * STEPS
    assert replayed == list(zip(kinds, range(2 * STEPS + 1), strict=True))
    assert _loss(fresh, run) == pytest.approx(_loss(engine, run), rel=1e-6)


def test_a_missing_snapshot_makes_the_run_unrestorable(
    rows: Rows, engine: Engine, tmp_path: Path
) -> None:
    host = worker_host(rows.database, rows.clock, engine, tmp_path / "art", snapshot_every_steps=2)
    host.register([MODEL], host.store)
    run = _trained(rows, host)
    snapshot = rows.training_run(run).snapshot_uri
    assert snapshot is not None
    host.store.delete(snapshot)
    fresh = cpu_engine(tmp_path / "fresh")
    executor = Executor(fresh, host.store, rows.database, rows.clock)
    with pytest.raises(RestoreImpossible, match=r"snapshot of .* is missing from the artifact"):
        restore_run(fresh, host.store, rows.database, executor, run)


def test_a_run_whose_log_before_its_snapshot_was_pruned_recovers_like_its_unpruned_twin(
    rows: Rows,
    engine: Engine,
    tmp_path: Path,
    replayed: list[tuple[OpKind, int | None]],
) -> None:
    host = worker_host(rows.database, rows.clock, engine, tmp_path / "art", snapshot_every_steps=2)
    host.register([MODEL], host.store)
    pruned = _stepped(rows, host)
    rows.clock.advance(RETENTION.total_seconds() + 60)
    twin = _stepped(rows, host)  # trained alike, too recently for its payloads to go
    for run in (pruned, twin):
        fb = 2 * STEPS + 1
        rows.training_op(
            run, fb, OpKind.FORWARD_BACKWARD, forward_backward_payload(run, fb, TOKENS)
        )
        rows.training_op(run, fb + 1)
    assert retention.prune(rows.database, rows.clock, RETENTION) == 5
    assert [op.payload_pruned_at is not None for op in rows.ops(pruned)] == [True] * 5 + [False] * 4
    assert all(op.payload_pruned_at is None for op in rows.ops(twin))

    # The worker dies; a fresh one takes both runs with their queued step (seq 7 and 8).
    replayed.clear()
    fresh = cpu_engine(tmp_path / "fresh")
    successor = worker_host(rows.database, rows.clock, fresh, tmp_path / "art")
    successor.register([MODEL], successor.store)
    assert successor.drain() == 4
    assert replayed == [(OpKind.FORWARD_BACKWARD, 5), (OpKind.OPTIM_STEP, 6)] * 2
    assert {op.status for run in (pruned, twin) for op in rows.ops(run)} == {"done"}
    assert _loss(fresh, pruned) == pytest.approx(_loss(fresh, twin), rel=1e-6)
    # The step after the restore counted: the run moved on from where the dead worker left it.
    assert _loss(fresh, pruned) != pytest.approx(_loss(engine, pruned), rel=1e-6)


def test_restoring_a_run_whose_replayed_payload_was_pruned_fails_naming_the_op(
    rows: Rows, engine: Engine, tmp_path: Path
) -> None:
    host = worker_host(rows.database, rows.clock, engine, tmp_path / "art", snapshot_every_steps=2)
    host.register([MODEL], host.store)
    run = _trained(rows, host)
    after_snapshot = rows.ops(run)[5]
    with rows.database.transaction() as db:  # what retention never does: replay needs seq 5
        assert oplog.prune_payloads(db, [after_snapshot.id], rows.clock.now()) == 1
    fresh = cpu_engine(tmp_path / "fresh")
    executor = Executor(fresh, host.store, rows.database, rows.clock)
    with pytest.raises(
        RestoreImpossible,
        match=rf"operation {after_snapshot.id} \(forward_backward, seq_id 5\).* was pruned",
    ):
        restore_run(fresh, host.store, rows.database, executor, run)


def _pinned_host(rows: Rows, engine: Engine, tmp_path: Path, **options: Any) -> WorkerHost:
    """A distributed worker `w1` (it runs only what is placed on it) beside a live `w2`."""
    host = worker_host(
        rows.database,
        rows.clock,
        engine,
        tmp_path / "art",
        worker_id="w1",
        owned_only=True,
        **options,
    )
    host.register([MODEL], host.store)
    rows.worker("w2", [MODEL])
    return host


def _stepped_on(rows: Rows, host: WorkerHost) -> str:
    """`_stepped`, on a run placed on the host's worker."""
    run = rows.run(rows.tenant(), rank=4, seed=3)
    with rows.database.transaction() as db:
        runs.assign_worker(db.get(TrainingRun, run), host.worker_id)
    for step in range(STEPS):
        fb, optim = 2 * step + 1, 2 * step + 2
        rows.training_op(
            run, fb, OpKind.FORWARD_BACKWARD, forward_backward_payload(run, fb, TOKENS)
        )
        rows.training_op(run, optim)
    assert host.drain() == 1 + 2 * STEPS
    return run


def test_a_worker_that_leaves_saves_its_run_so_the_next_one_replays_nothing(
    rows: Rows,
    engine: Engine,
    tmp_path: Path,
    replayed: list[tuple[OpKind, int | None]],
) -> None:
    host = _pinned_host(rows, engine, tmp_path, snapshot_every_steps=2)
    run = _stepped_on(rows, host)
    assert rows.training_run(run).snapshot_seq_id == 4  # the periodic one
    waiting = rows.training_op(run, 2 * STEPS + 1)  # queued when the worker leaves
    settings = make_settings(tmp_path, "sqlite:///unused.db")
    assert host.hand_over(settings) == {"w2": {run}}
    moved = rows.training_run(run)
    assert (moved.worker_id, moved.snapshot_seq_id) == ("w2", 2 * STEPS)
    assert rows.op(waiting.request_id).status == "queued"
    with rows.database.reader() as db:
        left = db.get(Worker, "w1")
        assert left is not None and (left.status, left.left_at) == ("left", rows.clock.now())
    replayed.clear()
    fresh = _restore(rows, host, tmp_path, run)
    assert replayed == []
    assert _loss(fresh, run) == pytest.approx(_loss(engine, run), rel=1e-6)


def test_a_run_with_gradients_pending_is_not_saved_as_its_worker_leaves(
    rows: Rows,
    engine: Engine,
    tmp_path: Path,
    replayed: list[tuple[OpKind, int | None]],
) -> None:
    """Its saved state would lack the gradients: the next worker replays them instead."""
    host = _pinned_host(rows, engine, tmp_path, snapshot_every_steps=2)
    run = _stepped_on(rows, host)
    fb = 2 * STEPS + 1
    rows.training_op(run, fb, OpKind.FORWARD_BACKWARD, forward_backward_payload(run, fb, TOKENS))
    assert host.drain() == 1
    assert host.hand_over(make_settings(tmp_path, "sqlite:///unused.db")) == {}
    moved = rows.training_run(run)
    assert (moved.worker_id, moved.snapshot_seq_id) == (None, 4)  # nothing queued: not placed
    replayed.clear()
    fresh = _restore(rows, host, tmp_path, run)
    assert replayed == [
        (OpKind.FORWARD_BACKWARD, 5),
        (OpKind.OPTIM_STEP, 6),
        (OpKind.FORWARD_BACKWARD, 7),
    ]
    assert fresh.gradients_pending(run)


def _grad_norm(rows: Rows, request_id: str) -> float:
    op = rows.op(request_id)
    assert op.status == "done" and op.result is not None and op.result_codec == "json"
    return float(json.loads(op.result)["metrics"]["grad_norm:mean"])


def test_an_op_whose_record_failed_is_run_again_on_the_recorded_state_not_on_top_of_itself(
    rows: Rows, engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that fails as a whole after the engine applied an op (its record refused): the
    run leaves the engine, so the op runs again on a state rebuilt from the log, instead of
    accumulating its gradients a second time."""
    host = worker_host(rows.database, rows.clock, engine, tmp_path / "art")
    host.register([MODEL], host.store)
    twins = [_stepped(rows, host) for _ in range(2)]
    fb, optim = 2 * STEPS + 1, 2 * STEPS + 2
    requests = {}
    for run in twins:
        rows.training_op(
            run, fb, OpKind.FORWARD_BACKWARD, forward_backward_payload(run, fb, TOKENS)
        )
        requests[run] = rows.training_op(run, optim).request_id
    original, failed = WorkerHost._store, []

    def refuse_once(self: WorkerHost, task: Task, outcome: Any) -> Any:
        if task.target_id == twins[1] and task.kind is OpKind.FORWARD_BACKWARD and not failed:
            failed.append(task.id)
            raise RuntimeError("the database went away while recording")
        return original(self, task, outcome)

    monkeypatch.setattr(WorkerHost, "_store", refuse_once)
    host.drain()
    assert failed and rows.op(failed[0]).attempts == 2  # run again, after the failed step
    assert _grad_norm(rows, requests[twins[1]]) == pytest.approx(
        _grad_norm(rows, requests[twins[0]]), rel=1e-6
    )
    assert _loss(engine, twins[1]) == pytest.approx(_loss(engine, twins[0]), rel=1e-6)


def test_a_worker_declared_dead_while_leaving_records_and_moves_nothing(
    rows: Rows, engine: Engine, tmp_path: Path
) -> None:
    """Beat got there first (the hand-over outlasted the lease): the failover is beat's, so the
    worker neither records a snapshot another worker might be restoring past, nor unpins."""
    host = _pinned_host(rows, engine, tmp_path, snapshot_every_steps=2)
    run = _stepped_on(rows, host)
    rows.clock.advance(60)
    with rows.database.transaction() as db:
        assert workers.declare_dead_lapsed(db, rows.clock.now()) == ["w1", "w2"]
    assert host.hand_over(make_settings(tmp_path, "sqlite:///unused.db")) is None
    after = rows.training_run(run)
    assert (after.worker_id, after.snapshot_seq_id) == ("w1", 4)
    with rows.database.reader() as db:
        dead = db.get(Worker, "w1")
        assert dead is not None and dead.status == "dead"
    assert not list((tmp_path / "art").rglob("snapshots/6"))  # the unrecorded save is gone
