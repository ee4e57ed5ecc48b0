"""`/admin/api/*`: the JSON (and CSV) every dashboard chart and table is drawn from.

Each route answers a browser holding an admin session cookie or a client sending an admin key
in `X-API-Key` (`api.admin.auth`); nothing here changes a row, and no answer may be cached
(`Cache-Control: no-store`, as the pages). The CSV's text cells that a spreadsheet would take
for a formula (a tenant or key name may start with `=`) are prefixed with `'`. The
routes are kept out of the OpenAPI document: they serve the dashboard, and may change with it.
"""

from __future__ import annotations

import csv
import io
from datetime import datetime

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from api.admin import overview
from api.admin.auth import ApiAdmin
from api.admin.usage import (
    Bucket,
    Group,
    UsageChart,
    parse_range,
    usage_chart,
)
from api.deps import ReadSession, State
from billing.limits import dollars

NO_STORE = {"Cache-Control": "no-store"}
# What a spreadsheet reads as the start of a formula when a cell begins with it.
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _no_store(response: Response) -> None:
    response.headers.update(NO_STORE)


router = APIRouter(prefix="/admin/api", include_in_schema=False, dependencies=[Depends(_no_store)])


def csv_cell(text: str) -> str:
    """A name as a CSV cell no spreadsheet runs: one starting like a formula gets a `'`."""
    return f"'{text}" if text.startswith(_FORMULA_STARTS) else text


class _Rows(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class SeriesOut(_Rows):
    key: str
    label: str
    tokens: list[int]
    cost_micros: list[int]


class TenantTotalOut(_Rows):
    tenant_id: str
    name: str
    tokens: int
    cost_micros: int
    cost: str


class UsageOut(_Rows):
    start: datetime
    end: datetime
    bucket: Bucket
    group: Group
    buckets: list[datetime]
    series: list[SeriesOut]
    top_tenants: list[TenantTotalOut]


class TenantOut(_Rows):
    tenant_id: str
    name: str
    disabled: bool
    max_concurrent_sessions: int
    open_sessions: int
    max_lora_rank: int
    spend_limit_micros: int | None
    session_spend_limit_micros: int | None
    spent_micros: int
    max_training_runs: int
    max_queued_ops: int


class KeyOut(_Rows):
    key_id: str
    tenant_id: str
    tenant_name: str
    name: str
    scope: str
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None


class TenantsOut(_Rows):
    tenants: list[TenantOut]
    keys: list[KeyOut]


class SessionOut(_Rows):
    session_id: str
    tenant_name: str
    kind: str
    created_at: datetime
    idle_seconds: float


class RunOut(_Rows):
    run_id: str
    tenant_id: str
    tenant_name: str
    base_model: str
    lora_rank: int
    worker_id: str | None
    status: str
    ops_in_flight: int
    last_op_age_seconds: float | None


class StuckOut(_Rows):
    op_id: str
    tenant_id: str
    target_id: str
    seq_id: int | None
    kind: str
    status: str
    waited_seconds: float
    reason: str


class FailedOut(_Rows):
    op_id: str
    tenant_name: str
    kind: str
    error_code: str | None
    error_category: str | None
    error_message: str
    finished_at: datetime | None


class LiveOut(_Rows):
    sessions: list[SessionOut]
    runs: list[RunOut]
    stuck: list[StuckOut]
    stuck_total: int
    failed: list[FailedOut]


class WorkerOut(_Rows):
    worker_id: str
    hostname: str
    device: str
    status: str
    lease_expires_in_seconds: float
    runs_placed: int
    runs_reported: int
    adapter_bytes: int
    queued_ops: int


class DepartureOut(_Rows):
    worker_id: str
    hostname: str
    status: str
    at: datetime


class FleetOut(_Rows):
    workers: list[WorkerOut]
    departures: list[DepartureOut]


def _chart(
    state: State, db: ReadSession, start: str | None, end: str | None, bucket: Bucket, group: Group
) -> UsageChart:
    first, last = parse_range(start, end, state.clock.now())
    return usage_chart(db, first, last, bucket, group)


@router.get("/usage")
def usage(
    _: ApiAdmin,
    state: State,
    db: ReadSession,
    start: str | None = None,
    end: str | None = None,
    bucket: Bucket = "day",
    group: Group = "tenant",
) -> UsageOut:
    """Tokens and cost per bucket of [start, end) (dates or ISO times, UTC by default; the last
    seven days when absent), one series per group, and the top tenants of the range."""
    chart = _chart(state, db, start, end, bucket, group)
    return UsageOut(
        start=chart.start,
        end=chart.end,
        bucket=chart.bucket,
        group=chart.group,
        buckets=chart.buckets,
        series=[SeriesOut.model_validate(s) for s in chart.series],
        top_tenants=[
            TenantTotalOut(
                tenant_id=t.tenant_id,
                name=t.name,
                tokens=t.tokens,
                cost_micros=t.cost_micros,
                cost=dollars(t.cost_micros),
            )
            for t in chart.top_tenants
        ],
    )


@router.get("/usage.csv")
def usage_csv(
    _: ApiAdmin,
    state: State,
    db: ReadSession,
    start: str | None = None,
    end: str | None = None,
    bucket: Bucket = "day",
    group: Group = "tenant",
) -> Response:
    """The same numbers as `/admin/api/usage`, one line per bucket and group with usage."""
    chart = _chart(state, db, start, end, bucket, group)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["bucket_start", group, "label", "tokens", "cost_micros", "cost"])
    for series in chart.series:
        for moment, tokens, cost in zip(
            chart.buckets, series.tokens, series.cost_micros, strict=True
        ):
            if tokens or cost:
                key, label = csv_cell(series.key), csv_cell(series.label)
                writer.writerow([moment.isoformat(), key, label, tokens, cost, dollars(cost)])
    name = f"usage-{chart.start:%Y%m%d}-{chart.end:%Y%m%d}-{bucket}-{group}.csv"
    return Response(
        out.getvalue(),
        media_type="text/csv; charset=utf-8",
        headers=NO_STORE | {"Content-Disposition": f'attachment; filename="{name}"'},
    )


@router.get("/tenants")
def tenants(_: ApiAdmin, state: State, db: ReadSession) -> TenantsOut:
    """Every tenant's limits, its spend this period and its open sessions; the API keys
    unrevoked or revoked in the last week."""
    now = state.clock.now()
    return TenantsOut(
        tenants=[TenantOut.model_validate(t) for t in overview.tenant_rows(db, now)],
        keys=[KeyOut.model_validate(k) for k in overview.key_rows(db, now)],
    )


@router.get("/live")
def live(_: ApiAdmin, state: State, db: ReadSession) -> LiveOut:
    """Open sessions, live training runs, the oldest operations waiting long (and how many
    wait), and recent failures."""
    return LiveOut.model_validate(overview.live(db, state.clock.now(), state.settings))


@router.get("/fleet")
def fleet(_: ApiAdmin, state: State, db: ReadSession) -> FleetOut:
    """The workers that run or hold queued ops, what each holds, and the latest workers that
    went away in the last day."""
    return FleetOut.model_validate(overview.fleet_view(db, state.clock.now()))
