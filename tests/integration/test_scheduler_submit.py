"""The op write path, called directly on each database: dedupe by (target_id, seq_id), the
concurrent-twin race, queue limits, and requests that arrive after their gap was released."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import func, select, text

from core.errors import InvalidInput, NotFound, RateLimited
from core.tables import Operation, TrainingRun
from scheduler import submit as submit_module
from scheduler.oplog import UNLOAD_SEQ
from scheduler.ops import OpKind, encode_json_payload
from scheduler.submit import RETRY_AFTER_SECONDS, Submitted, submit, submit_training_op
from tests.scheduling import Rows, migrated

pytestmark = pytest.mark.integration


@pytest.fixture
def rows(database_url: str) -> Rows:
    return Rows(migrated(database_url))


def _count(rows: Rows, target_id: str, seq_id: int) -> int:
    with rows.database.reader() as db:
        return (
            db.scalar(
                select(func.count())
                .select_from(Operation)
                .where(Operation.target_id == target_id, Operation.seq_id == seq_id)
            )
            or 0
        )


def _submit(
    rows: Rows,
    run_id: str,
    seq_id: int,
    *,
    tenant_id: str | None = None,
    before_commit: Callable[[Submitted], None] = lambda _: None,
) -> Submitted:
    """`submit` as the API calls it for a training op, optionally in another tenant's name;
    `before_commit` sees the answer while its transaction is still open."""
    payload, codec = encode_json_payload({"seq_id": seq_id})
    with rows.database.transaction() as db:
        run = db.get(TrainingRun, run_id)
        assert run is not None
        submitted = submit(
            db,
            rows.clock,
            tenant_id=tenant_id or run.tenant_id,
            session_id=run.session_id,
            target_id=run_id,
            seq_id=seq_id,
            kind=OpKind.OPTIM_STEP,
            payload=payload,
            payload_codec=codec,
            next_in_order=True,
        )
        before_commit(submitted)
        return submitted


def _a_backend_waits_on_a_lock(rows: Rows, seconds: float = 10.0) -> bool:
    """Whether another PostgreSQL session of this database is (or soon is) waiting on a lock."""
    waiting = text(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    deadline = time.monotonic() + seconds
    with rows.database.engine.connect() as connection:
        while time.monotonic() < deadline:
            if connection.execute(waiting).scalar_one():
                return True
            connection.rollback()  # a fresh snapshot of the statistics on each look
            time.sleep(0.01)
    return False


def test_a_resubmission_returns_the_original_request(rows: Rows) -> None:
    run = rows.run(rows.tenant())
    first = rows.training_op(run, 1)
    again = rows.training_op(run, 1)
    assert not first.duplicate
    assert again == Submitted(first.request_id, duplicate=True)
    assert _count(rows, run, 1) == 1


def test_a_seq_id_reused_by_another_kind_is_refused_naming_the_kind(rows: Rows) -> None:
    run = rows.run(rows.tenant())
    rows.training_op(run, 1, OpKind.OPTIM_STEP)
    with pytest.raises(InvalidInput, match=r"seq_id 1 of .* already used by a optim_step request"):
        rows.training_op(run, 1, OpKind.SAVE_WEIGHTS)
    with pytest.raises(InvalidInput, match="already used by a optim_step request"):
        rows.training_op(run, 1, OpKind.FORWARD_BACKWARD)
    assert _count(rows, run, 1) == 1


def test_another_tenants_target_and_seq_is_not_found(rows: Rows) -> None:
    owner, stranger = rows.tenant(), rows.tenant()
    run = rows.run(owner)
    rows.training_op(run, 1)
    with pytest.raises(NotFound, match="not found"):
        _submit(rows, run, 1, tenant_id=stranger)
    assert _count(rows, run, 1) == 1


def test_a_twin_that_missed_the_original_answers_with_its_request_id(
    rows: Rows, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submission whose first look found nothing, though the row is there when it inserts
    (as a twin committed in between): the insert does nothing on the unique index, the
    submission looks again and answers with the twin's request id, and the caller's
    transaction goes on to commit normally."""
    run = rows.run(rows.tenant())
    original = rows.training_op(run, 1)
    real_existing = submit_module._existing
    looks: list[bool] = []

    def existing_missed_once(*args: object) -> Operation | None:
        found = None if not looks else real_existing(*args)  # type: ignore[arg-type]
        looks.append(found is not None)
        return found

    monkeypatch.setattr(submit_module, "_existing", existing_missed_once)
    with rows.database.transaction() as db:
        run_row = db.get(TrainingRun, run)
        assert run_row is not None
        twin = submit_training_op(
            db,
            rows.clock,
            run=run_row,
            seq_id=1,
            kind=OpKind.OPTIM_STEP,
            payload=b"{}",
            payload_codec="json+zstd",
        )
        later = submit_training_op(
            db,
            rows.clock,
            run=run_row,
            seq_id=2,
            kind=OpKind.OPTIM_STEP,
            payload=b"{}",
            payload_codec="json+zstd",
        )
    assert looks == [False, True, False]  # missed, found after the refused insert; seq 2
    assert twin == Submitted(original.request_id, duplicate=True)
    assert not later.duplicate and _count(rows, run, 2) == 1
    assert _count(rows, run, 1) == 1


def test_concurrent_twins_insert_one_row_and_share_its_request_id(
    rows: Rows, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two transactions submit the same (target_id, seq_id) at the same moment.

    PostgreSQL: a barrier right after the dedupe check holds each until both have looked and
    found nothing; both then insert, and the unique index admits one. The winner holds its
    commit until the other's insert is seen waiting on the index; once the winner commits, that
    insert does nothing, and the loser answers with the winner's request id.

    SQLite: a write transaction holds the database's write lock from BEGIN, so the twins
    cannot both look before either commits (a barrier there would deadlock). They start
    together; the write lock makes the second wait until the first committed, and its dedupe
    check then finds the first's row. The index path is what the test above exercises.
    """
    run = rows.run(rows.tenant())
    concurrent_looks = not rows.database.is_sqlite
    start = threading.Barrier(2, timeout=30)
    looked = threading.Barrier(2, timeout=30)
    real_existing = submit_module._existing
    looks: list[bool] = []
    lock = threading.Lock()
    mine = threading.local()

    def existing(*args: object) -> Operation | None:
        found = real_existing(*args)  # type: ignore[arg-type]
        with lock:
            looks.append(found is not None)
        first_look = not getattr(mine, "looked", False)
        mine.looked = True
        if concurrent_looks and first_look:
            looked.wait()  # neither inserts before both have looked
        return found

    monkeypatch.setattr(submit_module, "_existing", existing)
    loser_waited: list[bool] = []

    def hold_the_commit(submitted: Submitted) -> None:
        if concurrent_looks and not submitted.duplicate:
            loser_waited.append(_a_backend_waits_on_a_lock(rows))

    def twin() -> Submitted:
        start.wait()
        return _submit(rows, run, 1, before_commit=hold_the_commit)

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(twin), pool.submit(twin)]
        results = [future.result(timeout=60) for future in futures]

    assert _count(rows, run, 1) == 1
    assert {r.request_id for r in results} == {rows.ops(run)[1].id}
    assert sorted(r.duplicate for r in results) == [False, True]
    if concurrent_looks:
        # Both looked and found nothing; the loser looked again after its insert was refused.
        assert looks == [False, False, True]
        assert loser_waited == [True]
    else:
        assert looks == [False, True]


def _limits_run(rows: Rows, **limits: int) -> tuple[str, str]:
    tenant = rows.tenant(**limits)
    run = rows.run(tenant)
    rows.executed(run, 0)  # created: seq 1 is the op the run waits for next
    return tenant, run


def test_beyond_the_queue_limit_only_the_next_op_and_unload_are_admitted(rows: Rows) -> None:
    _, run = _limits_run(rows, max_queued_ops=2)
    rows.training_op(run, 2)
    rows.training_op(run, 3)  # two queued: the limit
    with pytest.raises(RateLimited, match="allows 2 operations queued or running") as refused:
        rows.training_op(run, 4)
    assert refused.value.retry_after_seconds == RETRY_AFTER_SECONDS
    assert not rows.training_op(run, 1).duplicate  # what seq 2 and 3 wait for
    assert not rows.training_op(run, UNLOAD_SEQ, OpKind.UNLOAD_MODEL).duplicate
    # A resubmission of a queued op is answered before any limit is looked at.
    assert rows.training_op(run, 3).duplicate
    assert [op.seq_id for op in rows.ops(run)] == [0, 1, 2, 3, UNLOAD_SEQ]


def test_sampling_requests_have_their_own_limit(rows: Rows) -> None:
    tenant, run = _limits_run(rows, max_sampling_requests=1, max_queued_ops=3)
    sampler = rows.sampler(tenant)
    rows.sample_op(sampler, 0)
    with pytest.raises(RateLimited, match="allows 1 sampling requests") as refused:
        rows.sample_op(sampler, 1)
    assert refused.value.retry_after_seconds == RETRY_AFTER_SECONDS
    rows.training_op(run, 2)  # training ops are held to the queue limit only
    rows.training_op(run, 3)
    with pytest.raises(RateLimited, match="allows 3 operations queued or running"):
        rows.training_op(run, 4)


def test_a_late_arrival_is_recorded_failed_at_once_as_a_user_error(rows: Rows) -> None:
    run = rows.run(rows.tenant())
    rows.training_op(run, 5)
    rows.executed(run, 5)  # seq 1..4 never came; their gap was released
    late = rows.training_op(run, 3)
    assert not late.duplicate
    op = rows.op(late.request_id)
    assert (op.status, op.error_category) == ("failed", "user")
    assert op.finished_at == rows.clock.now()
    assert op.error_message is not None
    assert "seq_id 3 reached the server after later requests" in op.error_message
    assert "submit the work again with a new request" in op.error_message
    # Its resubmission answers with the same failed request; an executed one is a duplicate.
    assert rows.training_op(run, 3) == Submitted(late.request_id, duplicate=True)
    assert rows.training_op(run, 5).duplicate
    assert rows.op(rows.training_op(run, 6).request_id).status == "queued"


@pytest.mark.parametrize("seq_id", [0, -1])
def test_training_seq_ids_count_from_one(rows: Rows, seq_id: int) -> None:
    run = rows.run(rows.tenant())
    with pytest.raises(InvalidInput, match="count seq_id from 1"):
        rows.training_op(run, seq_id)
