"""The tenant's own usage, from the ledger (a Treadle extension of the protocol)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter
from pydantic import BeforeValidator

from api.deps import CurrentPrincipal, ReadSession
from api.openapi import error_responses
from billing.reports import usage_totals
from core.errors import InvalidInput
from treadle.types import UsageLine, UsageReport, dollars

router = APIRouter(prefix="/api/v1", tags=["usage"])


def _iso_only(value: object) -> object:
    """Pydantic would also read a number as a Unix time; the API promises ISO 8601 times."""
    if isinstance(value, str):
        try:
            datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(
                "not an ISO 8601 time; send one such as 2026-01-01T00:00:00Z"
            ) from None
    return value


IsoTime = Annotated[datetime | None, BeforeValidator(_iso_only)]


@router.get(
    "/usage",
    response_model=UsageReport,
    response_model_exclude_none=True,
    responses=error_responses(401, 403, 422),
)
def usage(
    principal: CurrentPrincipal,
    db: ReadSession,
    since: IsoTime = None,
    until: IsoTime = None,
) -> UsageReport:
    """Tokens, saves and storage per base model and kind with what they cost (in micro-units
    and as a decimal string), and the total, optionally within [since, until) (ISO times with
    a time zone)."""
    for name, moment in (("since", since), ("until", until)):
        if moment is not None and moment.tzinfo is None:
            raise InvalidInput(
                f"{name} has no time zone; send an ISO time such as 2026-01-01T00:00:00Z"
            )
    rows = usage_totals(db, principal.tenant_id, since=since, until=until)
    total = sum(row.amount_micros for row in rows)
    return UsageReport(
        since=since,
        until=until,
        lines=[
            UsageLine(
                base_model=row.base_model,
                kind=row.kind,
                quantity=row.quantity,
                amount_micros=row.amount_micros,
                amount=dollars(row.amount_micros),
            )
            for row in rows
        ],
        total_micros=total,
        total=dollars(total),
    )
