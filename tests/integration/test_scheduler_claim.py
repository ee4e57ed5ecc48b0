"""What a worker host claims, called directly on each database: per run the op whose seq_id
comes next, an unload once nothing precedes it, released gaps, samples oldest first, and ops
interrupted too often (given up, and counted finished) or before (claimed alone).

The engine is real (`treadle/tiny-1m` on the CPU) and executes the runs' creations; the ops
under test are only claimed, never executed, so each claim is seen as the host made it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from prometheus_client import REGISTRY

from scheduler.oplog import UNLOAD_SEQ
from scheduler.ops import OpKind
from tests.scheduling import MODEL, Rows, cpu_engine, migrated, worker_host

if TYPE_CHECKING:
    from gpu_worker.engine import Engine
    from scheduler.worker.host import WorkerHost

pytestmark = pytest.mark.integration

GAP_TIMEOUT = 120.0
HostFactory = Callable[..., "WorkerHost"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return cpu_engine(tmp_path_factory.mktemp("engine"))


@pytest.fixture
def rows(database_url: str) -> Rows:
    return Rows(migrated(database_url))


@pytest.fixture
def make_host(rows: Rows, engine: Engine, tmp_path: Path) -> Iterator[HostFactory]:
    """A registered worker host, as a (re)started embedded server builds it."""

    def make(**options: Any) -> WorkerHost:
        options.setdefault("gap_timeout_seconds", GAP_TIMEOUT)
        host = worker_host(rows.database, rows.clock, engine, tmp_path / "artifacts", **options)
        host.register([MODEL], host.store)
        return host

    yield make


def _claim(host: WorkerHost) -> list[tuple[str, int | None]]:
    """(target, seq_id) of each op one claim takes, in the order the host took them."""
    tasks, given_up = host._claim()
    assert given_up == 0
    return [(task.target_id, task.seq_id) for task in tasks]


def _created(rows: Rows, host: WorkerHost, count: int, **run_options: Any) -> list[str]:
    """`count` training runs of one tenant, created on the host's engine (seq 0 executed)."""
    tenant = rows.tenant()
    runs = [rows.run(tenant, **run_options) for _ in range(count)]
    assert host.drain() == count
    assert {rows.training_run(run).executed_seq_id for run in runs} == {0}
    return runs


def test_each_run_claims_only_its_next_seq_and_runs_are_claimed_together(
    rows: Rows, make_host: HostFactory
) -> None:
    host = make_host()
    a, b, c = _created(rows, host, 3)
    for seq in (3, 2, 1):
        rows.training_op(a, seq)
    rows.training_op(b, 1)
    rows.training_op(c, 2)  # c's seq 1 has not arrived
    assert sorted(_claim(host)) == sorted([(a, 1), (b, 1)])
    claimed = rows.ops(a)[1]
    assert (claimed.status, claimed.attempts, claimed.worker_id) == ("running", 1, "embedded")
    assert claimed.started_at == rows.clock.now()
    # a's seq 2 waits for seq 1 to be recorded, not merely claimed.
    assert _claim(host) == []
    rows.executed(a, 1)
    assert _claim(host) == [(a, 2)]


def test_an_unload_is_claimed_once_nothing_before_it_is_queued_or_running(
    rows: Rows, make_host: HostFactory
) -> None:
    host = make_host()
    a, b = _created(rows, host, 2)
    rows.training_op(a, 1)
    rows.training_op(a, UNLOAD_SEQ, OpKind.UNLOAD_MODEL)
    rows.training_op(b, 3)  # b's seq 1 and 2 are missing: a gap, younger than the timeout
    rows.training_op(b, UNLOAD_SEQ, OpKind.UNLOAD_MODEL)
    assert _claim(host) == [(a, 1)]
    assert _claim(host) == []  # a's seq 1 is running
    rows.executed(a, 1)
    assert _claim(host) == [(a, UNLOAD_SEQ)]
    # b's unload still waits behind its queued seq 3.
    assert rows.ops(b)[-1].status == "queued"


def test_a_gap_older_than_the_timeout_is_released_and_a_younger_one_is_not(
    rows: Rows, make_host: HostFactory
) -> None:
    host = make_host()
    old, young, present = _created(rows, host, 3)
    rows.training_op(old, 4)
    rows.training_op(old, 3)  # seq 1 and 2 never arrive
    rows.training_op(present, 1)
    rows.training_op(present, 3)  # seq 2 never arrives, but seq 1 is there
    assert _claim(host) == [(present, 1)]
    rows.clock.advance(GAP_TIMEOUT - 1)
    rows.training_op(young, 2)  # seq 1 never arrives
    rows.clock.advance(1)  # old and present have waited the timeout; young has not

    # A host's first claim looks for gaps (then at most once a second). Another worker's, so
    # that registering it leaves present's running seq 1 alone.
    fresh = make_host(worker_id="other")
    assert _claim(fresh) == [(old, 3)]
    assert rows.training_run(old).executed_seq_id == 2  # seq 1 and 2 given up
    assert rows.training_run(young).executed_seq_id == 0
    # present's seq 2 is the next it expects only once seq 1 is recorded; a running op holds
    # its run's order, so nothing is released there either.
    assert rows.training_run(present).executed_seq_id == 0


def test_a_gap_is_timed_from_the_oldest_op_waiting_behind_it(
    rows: Rows, make_host: HostFactory
) -> None:
    host = make_host()
    [run] = _created(rows, host, 1)
    rows.training_op(run, 3)
    rows.clock.advance(GAP_TIMEOUT - 1)
    rows.training_op(run, 2)  # seq 1 never arrives; seq 3 has waited behind it longest
    assert _claim(make_host(worker_id="early")) == []
    assert rows.training_run(run).executed_seq_id == 0
    rows.clock.advance(1)
    assert _claim(make_host(worker_id="due")) == [(run, 2)]
    assert rows.training_run(run).executed_seq_id == 1


def test_samples_are_claimed_oldest_first_up_to_the_batch_size(
    rows: Rows, make_host: HostFactory
) -> None:
    host = make_host(max_sample_batch=3)
    tenant = rows.tenant()
    first, second = rows.sampler(tenant), rows.sampler(tenant)
    order = [(second, 9), (first, 5), (second, 1), (first, 2), (first, 7)]
    for sampler, seq in order:
        rows.sample_op(sampler, seq)
        rows.clock.advance(1)
    assert _claim(host) == order[:3]
    assert _claim(host) == order[3:]
    assert _claim(host) == []


def test_a_claim_takes_whichever_kinds_are_queued_training_ops_samples_or_both(
    rows: Rows, make_host: HostFactory
) -> None:
    # The look before the claim says which kinds are queued; the claim queries only those.
    host = make_host()
    [run] = _created(rows, host, 1)
    sampler = rows.sampler(rows.tenant())
    rows.sample_op(sampler, 1)
    assert _claim(host) == [(sampler, 1)]
    rows.training_op(run, 1)
    assert _claim(host) == [(run, 1)]
    rows.executed(run, 1)
    rows.training_op(run, 2)
    rows.sample_op(sampler, 2)
    assert sorted(_claim(host)) == sorted([(run, 2), (sampler, 2)])
    assert _claim(host) == []


def test_an_op_claimed_max_attempts_times_is_given_up_and_its_run_goes_on(
    rows: Rows, make_host: HostFactory, caplog: pytest.LogCaptureFixture
) -> None:
    host = make_host(max_attempts=2)
    [run] = _created(rows, host, 1)
    poison = rows.training_op(run, 1).request_id
    rows.training_op(run, 2)
    for _ in range(2):  # claimed, then the worker dies and restarts with the op running
        assert _claim(host) == [(run, 1)]
        host = make_host(max_attempts=2)  # registering requeues what it left running
    finished = {"kind": "optim_step", "outcome": "failed", "category": "server"}
    before = REGISTRY.get_sample_value("treadle_ops_finished_total", finished) or 0.0
    caplog.clear()  # only the lines of what follows
    with caplog.at_level(logging.INFO, logger="treadle.ops"):
        tasks, given_up = host._claim()
    assert (tasks, given_up) == ([], 1)
    [line] = [r for r in caplog.records if r.name == "treadle.ops"]  # logged as it is counted
    assert (line.__dict__["op_id"], line.__dict__["outcome"]) == (poison, "failed")
    assert line.__dict__["error_category"] == "server" and line.__dict__["target_id"] == run
    # Given up is finished: counted once, as the server's failure, so none stays in flight.
    assert REGISTRY.get_sample_value("treadle_ops_finished_total", finished) == before + 1
    op = rows.op(poison)
    assert (op.status, op.error_category, op.attempts) == ("failed", "server", 2)
    assert op.error_message is not None
    assert "interrupted 2 times" in op.error_message and "given up" in op.error_message
    assert rows.training_run(run).executed_seq_id == 1
    assert _claim(host) == [(run, 2)]


def test_an_op_released_after_its_last_attempt_is_given_up_and_counted(
    rows: Rows, make_host: HostFactory, caplog: pytest.LogCaptureFixture
) -> None:
    host = make_host(max_attempts=1)
    [run] = _created(rows, host, 1)
    step = rows.training_op(run, 1).request_id
    tasks, _ = host._claim()
    finished = {"kind": "optim_step", "outcome": "failed", "category": "server"}
    before = REGISTRY.get_sample_value("treadle_ops_finished_total", finished) or 0.0
    caplog.clear()  # only the lines of what follows
    with caplog.at_level(logging.INFO, logger="treadle.ops"):
        host._requeue(tasks, counted=True)  # as after a failed engine step
    [line] = [r for r in caplog.records if r.name == "treadle.ops"]
    assert (line.__dict__["op_id"], line.__dict__["outcome"]) == (step, "failed")
    assert REGISTRY.get_sample_value("treadle_ops_finished_total", finished) == before + 1
    assert rows.op(step).status == "failed"


def test_an_interrupted_op_is_claimed_alone(rows: Rows, make_host: HostFactory) -> None:
    host = make_host()
    a, b, c = _created(rows, host, 3)
    rows.training_op(a, 1)
    assert _claim(host) == [(a, 1)]
    host = make_host()  # a restart: a's seq 1 is queued again, one attempt used
    rows.training_op(b, 1)
    rows.training_op(c, 1)
    assert _claim(host) == [(a, 1)]
    assert rows.ops(a)[1].attempts == 2
    assert sorted(_claim(host)) == sorted([(b, 1), (c, 1)])
