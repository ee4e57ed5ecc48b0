"""The tenant's own usage, from the ledger (a Treadle extension of the protocol)."""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter

from api.deps import CurrentPrincipal, DbSession
from billing.ledger import usage_by_model_and_kind
from core.errors import InvalidInput
from treadle.types import UsageLine, UsageReport

router = APIRouter(prefix="/api/v1", tags=["usage"])


@router.get("/usage", response_model=UsageReport, response_model_exclude_none=True)
def usage(
    principal: CurrentPrincipal,
    db: DbSession,
    since: datetime | None = None,
    until: datetime | None = None,
) -> UsageReport:
    """Tokens and saves per base model and kind, optionally within [since, until) (ISO times
    with a time zone)."""
    for name, moment in (("since", since), ("until", until)):
        if moment is not None and moment.tzinfo is None:
            raise InvalidInput(
                f"{name} has no time zone; send an ISO time such as 2026-01-01T00:00:00Z"
            )
    rows = usage_by_model_and_kind(db, principal.tenant_id, since=since, until=until)
    return UsageReport(
        since=since,
        until=until,
        lines=[UsageLine(base_model=m, kind=k, quantity=q) for m, k, q in rows],
    )
