"""The tenant's audit log, as the tinker SDK's `AdminClient.get_audit_log` reads it: one UTC
day of entries at a time, optionally of one resource.

Treadle's resources map onto the SDK's event types thus: `checkpoints` are checkpoint events
(published, unpublished, deleted), `organizations` are the tenant's own (API keys, limits,
billing links); Treadle has no projects or teams, so those types are always empty.
"""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, time, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BeforeValidator

from api.deps import CurrentPrincipal, ReadSession, State
from api.openapi import error_responses
from core import audit
from core.tables import AuditLog
from treadle.types import AuditEventType, AuditLogEntry, AuditLogResponse

router = APIRouter(prefix="/api/v1", tags=["audit"])

ACTION_PREFIXES: dict[str, tuple[str, ...] | None] = {
    "all": None,
    "checkpoints": ("checkpoint.",),
    "organizations": ("tenant.", "api_key."),
    "projects": (),
    "teams": (),
}


_ISO_DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")


def _iso_day(value: object) -> object:
    """Pydantic would also read a number as a Unix time, and Python a week date; the document
    promises an RFC 3339 full date, which is what the tinker SDK sends."""
    if isinstance(value, str) and not _ISO_DAY.fullmatch(value):
        raise ValueError(
            f"{value[:40]!r} is not a day written YYYY-MM-DD; send one such as 2026-01-15"
        )
    return value


IsoDay = Annotated[date | None, BeforeValidator(_iso_day)]


def _entry(row: AuditLog) -> AuditLogEntry:
    details: dict[str, Any] = {"actor": row.actor}
    if row.target is not None:
        details["target"] = row.target
    details.update(row.detail or {})
    checkpoint = row.action.startswith("checkpoint.")
    return AuditLogEntry(
        timestamp=row.created_at,
        event=row.action.replace(".", "_"),
        event_details=details,
        model_id=details.get("model_id") if checkpoint else None,
        tinker_path=details.get("tinker_path") if checkpoint else None,
    )


@router.get("/audit", response_model=AuditLogResponse, responses=error_responses(401, 403, 422))
def audit_log(
    principal: CurrentPrincipal,
    db: ReadSession,
    state: State,
    event_type: Annotated[
        AuditEventType,
        Query(description="Which resource's events: all, checkpoints, or organizations."),
    ] = "all",
    day: Annotated[IsoDay, Query(description="A UTC day, e.g. 2026-01-15; default today.")] = None,
) -> AuditLogResponse:
    """Who changed the caller's API keys, limits and checkpoints on one UTC day, oldest first.
    `event_details` holds `actor` (an API key id, or "operator" for the server's admin CLI),
    `target` and what changed."""
    day = day or state.clock.now().astimezone(UTC).date()
    since = datetime.combine(day, time(), tzinfo=UTC)
    until = since + timedelta(days=1) if day < date.max else datetime.max.replace(tzinfo=UTC)
    rows = audit.entries(
        db,
        principal.tenant_id,
        since,
        until,
        action_prefixes=ACTION_PREFIXES[event_type],
    )
    return AuditLogResponse(entries=[_entry(row) for row in rows])
