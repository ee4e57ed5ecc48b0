"""Spend limits at submission, called directly on each database: an op's estimate is reserved
while it is in flight, the op that crosses a limit is admitted and the next one refused (free
ones too), a gap below an accepted seq is always filled, a refusal leaves no trace, and raising
the limit lets work go on."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import func, select

from billing import estimate
from billing.limits import GAP_FILL_SPAN
from billing.spend import add_spend
from billing.tables import Price, UsageEvent
from core import tenants
from core.errors import SpendLimitReached
from core.tables import AuditLog, Operation, Tenant, TrainingRun
from scheduler.oplog import UNLOAD_SEQ
from scheduler.ops import OpKind, encode_json_payload
from scheduler.submit import Submitted, submit_training_op
from tests.scheduling import MODEL, Rows, forward_backward_payload, migrated

pytestmark = pytest.mark.integration

TOKENS = 100  # each forward_backward here trains 100 tokens: 100 micro-units at 1 per token


@pytest.fixture
def rows(database_url: str) -> Rows:
    rows = Rows(migrated(database_url))
    with rows.database.transaction() as db:
        # One micro-unit per training token on the test model, so estimates are token counts.
        db.add(
            Price(
                base_model=MODEL,
                kind="training",
                unit_micros=1_000_000,
                cached_unit_micros=None,
                effective_from=datetime(1970, 1, 1, tzinfo=UTC),
                created_at=datetime(1970, 1, 1, tzinfo=UTC),
                created_by="test",
            )
        )
    return rows


def _limited(rows: Rows, *, monthly: int | None = None, per_session: int | None = None) -> str:
    tenant_id = rows.tenant()
    with rows.database.transaction() as db:
        tenant = db.get(Tenant, tenant_id)
        assert tenant is not None
        tenants.set_spend_limits(
            db, rows.clock, tenant, monthly_micros=monthly, per_session_micros=per_session
        )
    return tenant_id


def _submit(
    rows: Rows, run_id: str, seq_id: int, kind: OpKind = OpKind.FORWARD_BACKWARD
) -> Submitted:
    if kind is OpKind.FORWARD_BACKWARD:
        payload, codec = forward_backward_payload(run_id, seq_id, list(range(TOKENS + 1)))
        usage = estimate.training(TOKENS)
    else:
        payload, codec = encode_json_payload({})
        usage = ()
    with rows.database.transaction() as db:
        run = db.get(TrainingRun, run_id)
        assert run is not None
        return submit_training_op(
            db,
            rows.clock,
            run=run,
            seq_id=seq_id,
            kind=kind,
            payload=payload,
            payload_codec=codec,
            usage=usage,
        )


def _reserved(rows: Rows, run_id: str) -> dict[int | None, int]:
    return {op.seq_id: op.reserved_micros for op in rows.ops(run_id) if op.seq_id}


def test_the_op_that_crosses_the_limit_is_admitted_and_the_next_refused(rows: Rows) -> None:
    run = rows.run(_limited(rows, monthly=250))
    for seq_id in (1, 2, 3):  # 0, 100, 200 reserved before each: all below 250
        _submit(rows, run, seq_id)
    assert _reserved(rows, run) == {1: TOKENS, 2: TOKENS, 3: TOKENS}

    with pytest.raises(SpendLimitReached) as refused:
        _submit(rows, run, 4)
    message = refused.value.message
    assert "has spent $0.00 (and $0.0003 is held for work in flight)" in message
    assert "of its $0.00025 limit" in message
    assert f"billing period {rows.clock.now():%Y-%m} (UTC)" in message
    assert "treadle-server admin tenants set-limit" in message and "--monthly" in message
    # A free op is refused too: admitted, it would only wait for the refused one.
    with pytest.raises(SpendLimitReached):
        _submit(rows, run, 4, OpKind.OPTIM_STEP)
    # Unloading frees resources and is never held back.
    _submit(rows, run, UNLOAD_SEQ, OpKind.UNLOAD_MODEL)


def test_a_gap_below_an_accepted_seq_is_filled_over_the_limit(rows: Rows) -> None:
    run = rows.run(_limited(rows, monthly=150))
    _submit(rows, run, 2)  # arrived before seq 1, as the tinker SDK sends a batch's chunks
    _submit(rows, run, 3)  # crosses the limit
    with pytest.raises(SpendLimitReached):
        _submit(rows, run, 4)
    _submit(rows, run, 1)  # below seq 3: refusing it would stall 2 and 3 behind the gap
    assert _reserved(rows, run) == {1: TOKENS, 2: TOKENS, 3: TOKENS}


def test_an_op_parked_far_ahead_does_not_open_the_run_past_its_limit(rows: Rows) -> None:
    run = rows.run(_limited(rows, monthly=150))
    _submit(rows, run, 1)
    _submit(rows, run, 10**9, OpKind.OPTIM_STEP)  # parked while under the limit
    _submit(rows, run, 2)  # crosses the limit
    with pytest.raises(SpendLimitReached):
        _submit(rows, run, 3)  # far below the parked op: not a chunk of a call it waits for
    assert GAP_FILL_SPAN < 10**9 - 3


def test_a_refusal_leaves_no_trace(rows: Rows) -> None:
    tenant_id = _limited(rows, monthly=0)
    run = rows.run(tenant_id)
    with rows.database.reader() as db:
        ops_before = db.scalar(select(func.count()).select_from(Operation))
        events_before = db.scalar(select(func.count()).select_from(UsageEvent))
    before = rows.training_run(run)

    with pytest.raises(SpendLimitReached, match=r"of its \$0.00 limit"):
        _submit(rows, run, 1)

    with rows.database.reader() as db:
        assert db.scalar(select(func.count()).select_from(Operation)) == ops_before
        assert db.scalar(select(func.count()).select_from(UsageEvent)) == events_before
    after = rows.training_run(run)
    assert (after.executed_seq_id, after.status, after.last_request_at) == (
        before.executed_seq_id,
        before.status,
        before.last_request_at,
    )


def test_settled_spend_counts_and_a_raised_limit_lets_work_go_on(rows: Rows) -> None:
    tenant_id = _limited(rows, monthly=200)
    run = rows.run(tenant_id)
    rows.executed(run, 0)
    _submit(rows, run, 1)
    _submit(rows, run, 2)
    # The ops end: their reservations no longer count, their real cost does.
    rows.executed(run, 1)
    rows.executed(run, 2)
    with rows.database.transaction() as db:
        add_spend(db, tenant_id, rows.clock.now(), 2 * TOKENS)
    assert _reserved(rows, run) == {1: TOKENS, 2: TOKENS}  # kept on the rows, not counted
    with pytest.raises(SpendLimitReached, match=r"has spent \$0.0002 \(and \$0.00 is held"):
        _submit(rows, run, 3)

    with rows.database.transaction() as db:
        tenant = db.get(Tenant, tenant_id)
        assert tenant is not None
        tenants.set_spend_limits(db, rows.clock, tenant, monthly_micros=1_000)
    _submit(rows, run, 3)
    with rows.database.reader() as db:
        entry = db.scalars(
            select(AuditLog).where(
                AuditLog.tenant_id == tenant_id, AuditLog.action == "tenant.limit_changed"
            )
        ).all()[-1]
        assert entry.actor == "operator"
        assert entry.detail == {"spend_limit_micros": {"from": 200, "to": 1_000}}


def test_a_session_limit_holds_one_session_only(rows: Rows) -> None:
    tenant_id = _limited(rows, per_session=150)
    first = rows.run(tenant_id)
    second = rows.run(tenant_id)  # in a session of its own
    _submit(rows, first, 1)
    _submit(rows, first, 2)  # crosses the session's limit
    with pytest.raises(SpendLimitReached) as refused:
        _submit(rows, first, 3)
    assert "session spend limit reached" in refused.value.message
    assert "--per-session" in refused.value.message
    _submit(rows, second, 1)
    _submit(rows, second, 2)


def test_without_a_limit_nothing_is_reserved(rows: Rows) -> None:
    run = rows.run(rows.tenant())
    payload, codec = forward_backward_payload(run, 1, list(range(TOKENS + 1)))
    with rows.database.transaction() as db:
        training_run = db.get(TrainingRun, run)
        assert training_run is not None
        # The API passes no usage for a tenant without a limit: nothing is priced.
        submit_training_op(
            db,
            rows.clock,
            run=training_run,
            seq_id=1,
            kind=OpKind.FORWARD_BACKWARD,
            payload=payload,
            payload_codec=codec,
        )
    assert _reserved(rows, run) == {1: 0}
