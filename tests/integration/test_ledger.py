"""The usage ledger, called directly on each database: recording is idempotent per
(operation, kind), so a redelivered or replayed operation is never billed twice."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from billing.ledger import UsageLine, record_usage
from billing.prices import cost_micros, rate_in_force
from billing.reports import usage_totals
from billing.spend import period_spend
from billing.tables import UsageEvent, UsageRollup
from tests.embedded_app import datum, embedded_app
from tests.scheduling import MODEL, Rows, migrated

pytestmark = pytest.mark.integration


@pytest.fixture
def rows(database_url: str) -> Rows:
    return Rows(migrated(database_url))


def _record(rows: Rows, tenant_id: str, operation_id: str, lines: list[UsageLine]) -> None:
    with rows.database.transaction() as db:
        record_usage(
            db,
            rows.clock,
            tenant_id=tenant_id,
            api_key_id=None,
            session_id=None,
            operation_id=operation_id,
            base_model=MODEL,
            lines=lines,
        )


def _totals(rows: Rows, tenant_id: str) -> list[tuple[str, str, int]]:
    with rows.database.reader() as db:
        return [(t.base_model, t.kind, t.quantity) for t in usage_totals(db, tenant_id)]


def _events(rows: Rows) -> list[tuple[str, str, int]]:
    with rows.database.reader() as db:
        return [
            (e.operation_id, e.kind, e.quantity)
            for e in db.scalars(
                select(UsageEvent).order_by(UsageEvent.operation_id, UsageEvent.kind)
            )
        ]


def test_recording_an_operation_twice_leaves_one_row_per_kind(rows: Rows) -> None:
    tenant = rows.tenant()
    op = rows.ops(rows.run(tenant))[0].id
    _record(rows, tenant, op, [UsageLine("training", 10), UsageLine("sampling_sample", 3)])
    rows.clock.advance(60)
    # A redelivery records again, in its own transaction: the first record stands; a kind not
    # recorded before is added.
    _record(rows, tenant, op, [UsageLine("training", 99), UsageLine("checkpoint", 5)])
    _record(rows, tenant, op, [UsageLine("training", 10), UsageLine("sampling_sample", 3)])
    assert _events(rows) == [
        (op, "checkpoint", 5),
        (op, "sampling_sample", 3),
        (op, "training", 10),
    ]
    assert _totals(rows, tenant) == [
        (MODEL, "checkpoint", 5),
        (MODEL, "sampling_sample", 3),
        (MODEL, "training", 10),
    ]


def test_operations_are_counted_apart(rows: Rows) -> None:
    tenant = rows.tenant()
    run = rows.run(tenant)
    first, second = rows.ops(run)[0].id, rows.training_op(run, 1).request_id
    for op in (first, second, first):
        _record(rows, tenant, op, [UsageLine("training", 7)])
    assert _totals(rows, tenant) == [(MODEL, "training", 14)]


def test_zero_quantities_write_nothing(rows: Rows) -> None:
    tenant = rows.tenant()
    op = rows.ops(rows.run(tenant))[0].id
    _record(rows, tenant, op, [UsageLine("training", 0), UsageLine("sampling_prefill", 0)])
    _record(rows, tenant, op, [])
    assert _events(rows) == []
    # A zero line leaves its kind free: a later real quantity of it is recorded.
    _record(rows, tenant, op, [UsageLine("training", 0), UsageLine("sampling_prefill", 4)])
    assert _events(rows) == [(op, "sampling_prefill", 4)]


def test_an_unknown_kind_is_refused_and_nothing_is_written(rows: Rows) -> None:
    tenant = rows.tenant()
    op = rows.ops(rows.run(tenant))[0].id
    with pytest.raises(ValueError, match="unknown usage kind 'gpu_hours'"):
        _record(rows, tenant, op, [UsageLine("training", 1), UsageLine("gpu_hours", 1)])
    assert _events(rows) == []


def test_an_op_through_the_api_is_priced_and_counted_as_its_key_and_session(
    tmp_path: Path, database_url: str
) -> None:
    with embedded_app(tmp_path, database_url) as app:
        headers = app.tenant()
        key_id = headers["X-API-Key"].split("-")[1]
        run = app.run(headers)
        datum_ = datum([5, 6, 7, 8, 9])
        body = {"model_id": run, "seq_id": 1, "data": [datum_], "loss_fn": "cross_entropy"}
        app.op(headers, "forward_backward", body)
        with app.database.reader() as db:
            [event] = db.scalars(select(UsageEvent)).all()
            rate = rate_in_force(db, MODEL, "training", event.created_at)
            rollups = db.scalars(select(UsageRollup)).all()
            spent = period_spend(db, event.tenant_id, event.created_at)
    assert rate is not None and rate.base_model == "*"  # the default version
    assert (event.kind, event.quantity, event.api_key_id) == ("training", 4, key_id)
    assert (event.price_id, event.amount_micros) == (rate.id, cost_micros(rate, 4))
    assert [
        (r.api_key_id, r.session_id, r.kind, r.price_id, r.events, r.quantity, r.amount_micros)
        for r in rollups
    ] == [(key_id, event.session_id, "training", rate.id, 1, 4, event.amount_micros)]
    assert spent == event.amount_micros
