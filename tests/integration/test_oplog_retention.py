"""Op-log retention on each database: a finished op's payload is emptied once it is older than
the retention age and nothing can replay it (at or below its run's snapshot, a sampling request,
an op of an ended run); queued and running ops and a live run's ops after its snapshot keep
theirs, results stay, and pruning again changes nothing."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pydantic import ValidationError

from core import runs, sessions
from core.settings import Settings
from core.tables import Operation, TrainingRun
from scheduler import oplog, retention
from scheduler.failures import OpFailure
from scheduler.futures import read_future
from tests.scheduling import MODEL, Rows, migrated

pytestmark = pytest.mark.integration

RETENTION = timedelta(days=7)


@pytest.fixture
def rows(database_url: str) -> Rows:
    return Rows(migrated(database_url))


def _trained(rows: Rows, tenant_id: str, executed: int) -> str:
    """A run whose ops 0..`executed` are done now."""
    run = rows.run(tenant_id)
    for seq in range(1, executed + 1):
        rows.training_op(run, seq)
    rows.executed(run, executed)
    return run


def _end(rows: Rows, run_id: str, *, unload: bool) -> None:
    """End the run's session, after unloading the run (`unload`) or leaving it active."""
    with rows.database.transaction() as db:
        run = db.get(TrainingRun, run_id)
        assert run is not None
        if unload:
            runs.unload(run)
        sessions.finish(
            db,
            rows.clock,
            tenant_id=run.tenant_id,
            session_id=run.session_id,
            reason="done",
            detail=None,
            ttl_seconds=3600,
        )


def _pruned(rows: Rows, target_id: str) -> dict[int | None, bool]:
    """seq_id → whether the op's payload was emptied (it then reads b"", and says when)."""
    found = {}
    for op in rows.ops(target_id):
        assert (op.payload == b"") is (op.payload_pruned_at is not None)
        found[op.seq_id] = op.payload_pruned_at is not None
    return found


def test_retention_prunes_only_what_nothing_replays_once_old_enough(rows: Rows) -> None:
    tenant = rows.tenant()
    live = rows.run(tenant)
    for seq in range(1, 7):
        rows.training_op(live, seq)
    with rows.database.transaction() as db:  # seq 2 failed rather than done
        failed = db.get(Operation, rows.ops(live)[2].id)
        assert failed is not None
        oplog.fail_now(failed, OpFailure.user("bad batch"), rows.clock.now())
    rows.executed(live, 6)
    with rows.database.transaction() as db:
        run = db.get(TrainingRun, live)
        assert run is not None
        runs.record_snapshot(run, 4, "file:///snapshots/4")
    unloaded = _trained(rows, tenant, 2)
    _end(rows, unloaded, unload=True)
    # Ended with its session but still active: it could be restored for an op queued before
    # the session ended, so only its snapshot would free its payloads (it has none).
    orphaned = _trained(rows, tenant, 2)
    _end(rows, orphaned, unload=False)
    sampler = rows.sampler(tenant)
    rows.worker("w1", [MODEL])
    rows.training_op(live, 7)  # claimed below: running
    rows.training_op(live, 8)  # waits for 7: queued
    sampled = rows.sample_op(sampler, 0)
    with rows.database.transaction() as db:
        ready, _ = oplog.claim(
            db,
            oplog.ReadyQueries.build(None),
            worker_id="w1",
            now=rows.clock.now(),
            max_attempts=3,
            max_samples=8,
        )
        assert {r.op.seq_id for r in ready if r.op.target_id == live} == {7}
        assert oplog.finish(db, sampled, rows.clock.now(), b"tokens", "json") is not None
    waiting = rows.sample_op(sampler, 1)
    payloads = {op.id: op.payload for target in (live, sampler) for op in rows.ops(target)}

    rows.clock.advance(RETENTION.total_seconds() - 1)
    assert retention.prune(rows.database, rows.clock, RETENTION) == 0
    assert not any(_pruned(rows, live).values())

    rows.clock.advance(2)
    pruned_at = rows.clock.now()
    # Small batches: the job loops until a batch comes back short.
    assert retention.prune(rows.database, rows.clock, RETENTION, batch=2) == 5 + 1 + 3
    assert _pruned(rows, live) == {seq: seq <= 4 for seq in range(9)}
    assert _pruned(rows, sampler) == {0: True, 1: False}
    assert all(_pruned(rows, unloaded).values())
    assert not any(_pruned(rows, orphaned).values())
    for target in (live, sampler):
        for op in rows.ops(target):
            if op.payload_pruned_at is None:
                assert op.payload == payloads[op.id]
            else:
                assert op.payload_pruned_at.timestamp() == pruned_at.timestamp()
    assert [op.status for op in rows.ops(live)[7:]] == ["running", "queued"]
    assert rows.op(waiting).status == "queued"
    # A pruned op's future still answers with its result.
    with rows.database.rows() as db:
        assert read_future(db, tenant, sampled).result == b"tokens"

    rows.clock.advance(3600)
    assert retention.prune(rows.database, rows.clock, RETENTION) == 0
    assert rows.op(sampled).payload_pruned_at.timestamp() == pruned_at.timestamp()  # type: ignore[union-attr]


def _sampled(rows: Rows, sampler: str, seq: int) -> str:
    """A sampling request on `sampler`, done now."""
    request_id = rows.sample_op(sampler, seq)
    with rows.database.transaction() as db:
        ready, _ = oplog.claim(
            db,
            oplog.ReadyQueries.build(None),
            worker_id="w1",
            now=rows.clock.now(),
            max_attempts=3,
            max_samples=8,
        )
        assert [r.op.id for r in ready] == [request_id]
        assert oplog.finish(db, request_id, rows.clock.now(), b"tokens", "json") is not None
    return request_id


def test_the_periodic_job_prunes_at_most_once_per_interval(rows: Rows) -> None:
    rows.worker("w1", [MODEL])
    sampler = rows.sampler(rows.tenant())
    first = _sampled(rows, sampler, 0)
    rows.clock.advance(300)
    second = _sampled(rows, sampler, 1)
    settings = Settings(oplog_retention_seconds=RETENTION.total_seconds())
    rows.clock.advance(RETENTION.total_seconds() - 299)
    retention.run_periodic(rows.database, settings, rows.clock)
    assert rows.op(first).payload_pruned_at is not None
    assert rows.op(second).payload_pruned_at is None  # not old enough yet
    rows.clock.advance(retention.EVERY_SECONDS - 1)
    retention.run_periodic(rows.database, settings, rows.clock)  # too soon after the last run
    assert rows.op(second).payload_pruned_at is None
    rows.clock.advance(1)
    retention.run_periodic(rows.database, settings, rows.clock)
    assert rows.op(second).payload_pruned_at is not None


def test_a_retention_below_an_hour_is_refused_with_what_to_set() -> None:
    with pytest.raises(ValidationError, match=r"OPLOG_RETENTION_SECONDS 60 .* at least 3600"):
        Settings(oplog_retention_seconds=60)
    assert Settings(oplog_retention_seconds=3600).oplog_retention_seconds == 3600
