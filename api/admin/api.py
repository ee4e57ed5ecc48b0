"""`/admin/api/*`: the JSON (and CSV) every dashboard chart and table is drawn from.

Each route answers a browser holding an admin session cookie or a client sending an admin key
in `X-API-Key` (`api.admin.auth`); nothing here changes a row, and no answer may be cached
(`Cache-Control: no-store`, as the pages). The CSV's text cells that a spreadsheet would take
for a formula (a tenant or key name may start with `=`) are prefixed with `'`. The answers
are the read models' frozen dataclasses (`api.admin.usage`, `api.admin.overview`,
`api.admin.billing`, `scheduler.fleet`), which FastAPI serialises as they are, so each shape
is declared once. The routes are kept out of the OpenAPI document: they serve the dashboard,
and may change with it.
"""

from __future__ import annotations

import csv
import io
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from pydantic import BaseModel

from api.admin import overview
from api.admin.auth import ApiAdmin
from api.admin.billing import Billing, billing_view
from api.admin.usage import (
    UsageChart,
    UsageQuery,
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


class TenantsOut(BaseModel):
    tenants: list[overview.TenantRow]
    keys: list[overview.KeyRow]


def _chart(state: State, db: ReadSession, query: Annotated[UsageQuery, Depends()]) -> UsageChart:
    first, last = parse_range(query.start, query.end, state.clock.now())
    return usage_chart(db, first, last, query.bucket, query.group)


# The chart a usage route's query asks for, parsed once its admin is authenticated.
Chart = Annotated[UsageChart, Depends(_chart)]


@router.get("/usage")
def usage(_: ApiAdmin, chart: Chart) -> UsageChart:
    """Tokens and cost per bucket of [start, end) (dates or ISO times, UTC by default; the last
    seven days when absent), one series per group, and the top tenants of the range."""
    return chart


@router.get("/usage.csv")
def usage_csv(_: ApiAdmin, chart: Chart) -> Response:
    """The same numbers as `/admin/api/usage`, one line per bucket and group with usage."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["bucket_start", chart.group, "label", "tokens", "cost_micros", "cost"])
    for series in chart.series:
        for moment, tokens, cost in zip(
            chart.buckets, series.tokens, series.cost_micros, strict=True
        ):
            if tokens or cost:
                key, label = csv_cell(series.key), csv_cell(series.label)
                writer.writerow([moment.isoformat(), key, label, tokens, cost, dollars(cost)])
    name = f"usage-{chart.start:%Y%m%d}-{chart.end:%Y%m%d}-{chart.bucket}-{chart.group}.csv"
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
    return TenantsOut(tenants=overview.tenant_rows(db, now), keys=overview.key_rows(db, now))


@router.get("/live")
def live(_: ApiAdmin, state: State, db: ReadSession) -> overview.Live:
    """Open sessions, live training runs, the oldest operations waiting long (and how many
    wait), and recent failures."""
    return overview.live(db, state.clock.now(), state.settings)


@router.get("/fleet")
def fleet(_: ApiAdmin, state: State, db: ReadSession) -> overview.Fleet:
    """The workers that run or hold queued ops, what each holds, and the latest workers that
    went away in the last day."""
    return overview.fleet_view(db, state.clock.now())


@router.get("/billing")
def billing(_: ApiAdmin, state: State, db: ReadSession) -> Billing:
    """Whether this server pushes usage to Stripe, how far Stripe's meters lag behind it, the
    parts that await the operator, and the latest reconciliation's result."""
    return billing_view(db, state.clock.now(), state.settings)
