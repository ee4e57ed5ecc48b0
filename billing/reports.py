"""What a tenant reads of its own usage and costs: totals per base model and kind over any
window (from the ledger), hourly buckets (from the rollups) with the price version each was
charged at, and the checkpoint storage it holds now.

Read-only, and scoped by tenant id in every query. It knows nothing of wire formats: the API
turns these rows into the Tinker and Treadle responses.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session as OrmSession

from billing.prices import Rate
from billing.rollups import DIMENSIONS, rollup_totals
from billing.tables import Price, UsageEvent
from core.tables import ApiKey, ModelVersion, Session, TrainingRun, VersionStatus


@dataclass(frozen=True)
class UsageTotal:
    base_model: str
    kind: str
    quantity: int
    amount_micros: int


def usage_totals(
    db: OrmSession, tenant_id: str, *, since: datetime | None = None, until: datetime | None = None
) -> list[UsageTotal]:
    """The tenant's usage and its cost per (base model, kind), of events recorded in
    [since, until), ordered by base model and kind."""
    query = select(
        UsageEvent.base_model,
        UsageEvent.kind,
        func.sum(UsageEvent.quantity),
        func.sum(UsageEvent.amount_micros),
    ).where(UsageEvent.tenant_id == tenant_id)
    if since is not None:
        query = query.where(UsageEvent.created_at >= since)
    if until is not None:
        query = query.where(UsageEvent.created_at < until)
    rows = db.execute(
        query.group_by(UsageEvent.base_model, UsageEvent.kind).order_by(
            UsageEvent.base_model, UsageEvent.kind
        )
    )
    return [
        UsageTotal(model, kind, int(quantity), int(amount or 0))
        for model, kind, quantity, amount in rows
    ]


@dataclass(frozen=True)
class HourlyUsage:
    """One hour of one kind of usage on one base model, by one API key in one session, at one
    price version (`rate` None: unpriced)."""

    hour: datetime
    api_key_id: str | None
    session_id: str | None
    base_model: str
    kind: str
    quantity: int
    cached_quantity: int
    amount_micros: int
    rate: Rate | None


def hourly_usage(
    db: OrmSession, tenant_id: str, since: datetime, until: datetime
) -> list[HourlyUsage]:
    """The tenant's rollups of hours in [since, until), ordered by hour, then by quantity,
    largest first."""
    totals = rollup_totals(db, tenant_id, since, until, group_by=DIMENSIONS)
    price_ids = {_price_id(t.group["price_id"]) for t in totals} - {0}
    rates = {
        row.id: Rate.of(row) for row in db.scalars(select(Price).where(Price.id.in_(price_ids)))
    }
    rows = [
        HourlyUsage(
            hour=_moment(t.group["hour"]),
            api_key_id=str(t.group["api_key_id"]) or None,
            session_id=str(t.group["session_id"]) or None,
            base_model=str(t.group["base_model"]),
            kind=str(t.group["kind"]),
            quantity=t.quantity,
            cached_quantity=t.cached_quantity,
            amount_micros=t.amount_micros,
            rate=rates.get(_price_id(t.group["price_id"])),
        )
        for t in totals
    ]
    rows.sort(key=lambda r: (r.hour, -r.quantity, r.kind, r.base_model, r.session_id or ""))
    return rows


def _price_id(value: object) -> int:
    assert isinstance(value, int)
    return value


def _moment(value: object) -> datetime:
    assert isinstance(value, datetime)
    return value


@dataclass(frozen=True)
class SessionDetails:
    project_id: str | None
    user_metadata: dict[str, Any] | None


def session_details(
    db: OrmSession, tenant_id: str, session_ids: Collection[str]
) -> dict[str, SessionDetails]:
    """The project and metadata of the tenant's sessions among `session_ids`."""
    if not session_ids:
        return {}
    rows = db.execute(
        select(Session.id, Session.project_id, Session.user_metadata).where(
            Session.tenant_id == tenant_id, Session.id.in_(list(session_ids))
        )
    )
    return {sid: SessionDetails(project, metadata) for sid, project, metadata in rows}


def key_names(db: OrmSession, tenant_id: str, key_ids: Collection[str]) -> dict[str, str]:
    """The names of the tenant's API keys among `key_ids`."""
    if not key_ids:
        return {}
    rows = db.execute(
        select(ApiKey.id, ApiKey.name).where(
            ApiKey.tenant_id == tenant_id, ApiKey.id.in_(list(key_ids))
        )
    )
    return {key_id: name for key_id, name in rows}


@dataclass(frozen=True)
class StoredCheckpoints:
    """The ready, unexpired checkpoints of one project and session owner (API key)."""

    project_id: str | None
    api_key_id: str | None
    count: int
    size_bytes: int


def stored_checkpoints(
    db: OrmSession, tenant_id: str, now: datetime, *, project_id: str | None = None
) -> list[StoredCheckpoints]:
    """What the tenant's storage is metered on at `now`, grouped by the project and the API key
    of the session that made each checkpoint (None for either when unknown)."""
    query = (
        select(
            Session.project_id,
            Session.api_key_id,
            func.count(),
            func.sum(func.coalesce(ModelVersion.size_bytes, 0)),
        )
        .select_from(ModelVersion)
        .outerjoin(TrainingRun, TrainingRun.id == ModelVersion.training_run_id)
        .outerjoin(Session, Session.id == TrainingRun.session_id)
        .where(
            ModelVersion.tenant_id == tenant_id,
            ModelVersion.status == VersionStatus.READY,
            or_(ModelVersion.expires_at.is_(None), ModelVersion.expires_at > now),
        )
        .group_by(Session.project_id, Session.api_key_id)
    )
    if project_id is not None:
        query = query.where(Session.project_id == project_id)
    rows = [
        StoredCheckpoints(project, key, int(count), int(size or 0))
        for project, key, count, size in db.execute(query)
    ]
    rows.sort(key=lambda r: (-r.size_bytes, r.project_id or "", r.api_key_id or ""))
    return rows
