"""What the dashboard's tenants, live and fleet pages show, read in one session at one `now`.

Runs, workers and waiting operations come from `scheduler.fleet`, the read model the admin CLI
prints; this module adds what that one does not hold: each tenant's limits beside its spend
this period and its open sessions, the API keys in use or revoked lately, the open sessions,
the latest failed operations and the workers that went away lately. Every query is bounded (a
time window and a LIMIT, or one row per tenant or running worker) so a page costs the same on a
server with years of history.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import case, func, or_, select
from sqlalchemy.orm import Session as OrmSession

from billing.spend import period_start
from billing.tables import TenantSpend
from core.settings import Settings
from core.tables import (
    ApiKey,
    Operation,
    OpStatus,
    Session,
    SessionKind,
    SessionStatus,
    Tenant,
    Worker,
    WorkerStatus,
)
from core.tenants import resource_limits
from scheduler import fleet

FAILED_OPS_SHOWN = 50
FAILED_OPS_WINDOW = timedelta(hours=24)
SESSIONS_SHOWN = 200
DEPARTURES_SHOWN = 50
DEPARTURES_WINDOW = timedelta(hours=24)
STUCK_AFTER_SECONDS = 60.0
STUCK_SHOWN = 100
KEYS_SHOWN = 500
REVOKED_KEYS_WINDOW = timedelta(days=7)


@dataclass(frozen=True)
class TenantRow:
    tenant_id: str
    name: str
    disabled: bool
    max_concurrent_sessions: int
    open_sessions: int
    """Client sessions open now (the ones the quota counts)."""
    max_lora_rank: int
    spend_limit_micros: int | None
    session_spend_limit_micros: int | None
    spent_micros: int
    """In the billing period holding `now`."""
    max_training_runs: int
    max_queued_ops: int


@dataclass(frozen=True)
class KeyRow:
    key_id: str
    tenant_id: str
    tenant_name: str
    name: str
    scope: str
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None


@dataclass(frozen=True)
class SessionRow:
    session_id: str
    tenant_name: str
    kind: str
    created_at: datetime
    idle_seconds: float


@dataclass(frozen=True)
class FailedOp:
    op_id: str
    tenant_name: str
    kind: str
    error_code: str | None
    error_category: str | None
    error_message: str
    finished_at: datetime | None
    """Set on every failed op; typed as its column is."""


@dataclass(frozen=True)
class Live:
    sessions: list[SessionRow]
    runs: list[fleet.RunRow]
    stuck: list[fleet.StuckOp]
    """The oldest `STUCK_SHOWN`."""
    stuck_total: int
    failed: list[FailedOp]


@dataclass(frozen=True)
class Departure:
    """A worker that left on purpose or whose lease lapsed, recently."""

    worker_id: str
    hostname: str
    status: str
    at: datetime


@dataclass(frozen=True)
class Fleet:
    workers: list[fleet.WorkerRow]
    departures: list[Departure]


def tenant_rows(db: OrmSession, now: datetime) -> list[TenantRow]:
    spent = dict(
        db.execute(
            select(TenantSpend.tenant_id, TenantSpend.spent_micros).where(
                TenantSpend.period_start == period_start(now)
            )
        ).all()
    )
    open_sessions = dict(
        db.execute(
            select(Session.tenant_id, func.count())
            .where(Session.status == SessionStatus.ACTIVE, Session.kind == SessionKind.CLIENT)
            .group_by(Session.tenant_id)
        ).all()
    )
    rows = []
    for tenant in db.scalars(select(Tenant).order_by(Tenant.name)):
        limits = resource_limits(tenant)
        rows.append(
            TenantRow(
                tenant_id=tenant.id,
                name=tenant.name,
                disabled=tenant.disabled,
                max_concurrent_sessions=tenant.max_concurrent_sessions,
                open_sessions=int(open_sessions.get(tenant.id, 0)),
                max_lora_rank=tenant.max_lora_rank,
                spend_limit_micros=tenant.spend_limit_micros,
                session_spend_limit_micros=tenant.session_spend_limit_micros,
                spent_micros=int(spent.get(tenant.id, 0)),
                max_training_runs=limits.max_training_runs,
                max_queued_ops=limits.max_queued_ops,
            )
        )
    return rows


def key_rows(db: OrmSession, now: datetime) -> list[KeyRow]:
    """The newest `KEYS_SHOWN` keys unrevoked or revoked in the last `REVOKED_KEYS_WINDOW`,
    newest first (the plain key is never stored, so never shown)."""
    found = db.execute(
        select(ApiKey, Tenant.name)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(or_(ApiKey.revoked_at.is_(None), ApiKey.revoked_at >= now - REVOKED_KEYS_WINDOW))
        .order_by(ApiKey.created_at.desc(), ApiKey.id)
        .limit(KEYS_SHOWN)
    ).all()
    return [
        KeyRow(
            key_id=key.id,
            tenant_id=key.tenant_id,
            tenant_name=tenant_name,
            name=key.name,
            scope=key.scope,
            created_at=key.created_at,
            last_used_at=key.last_used_at,
            revoked_at=key.revoked_at,
        )
        for key, tenant_name in found
    ]


def live(db: OrmSession, now: datetime, settings: Settings) -> Live:
    sessions = db.execute(
        select(Session, Tenant.name)
        .join(Tenant, Tenant.id == Session.tenant_id)
        .where(Session.status == SessionStatus.ACTIVE)
        .order_by(Session.last_heartbeat_at.desc(), Session.id)
        .limit(SESSIONS_SHOWN)
    ).all()
    return Live(
        sessions=[
            SessionRow(
                session_id=s.id,
                tenant_name=name,
                kind=s.kind,
                created_at=s.created_at,
                idle_seconds=(now - s.last_heartbeat_at).total_seconds(),
            )
            for s, name in sessions
        ],
        runs=fleet.runs(db, now),
        stuck=fleet.stuck_ops(db, now, settings, STUCK_AFTER_SECONDS, limit=STUCK_SHOWN),
        stuck_total=fleet.count_stuck_ops(db, now, STUCK_AFTER_SECONDS),
        failed=failed_ops(db, now),
    )


def failed_ops(db: OrmSession, now: datetime) -> list[FailedOp]:
    """The latest failed operations of the last day, newest first: the status equality uses
    the (status, target) index, and the window and LIMIT bound the rows sorted."""
    found = db.execute(
        select(
            Operation.id,
            Tenant.name,
            Operation.kind,
            Operation.error_code,
            Operation.error_category,
            Operation.error_message,
            Operation.finished_at,
        )
        .join(Tenant, Tenant.id == Operation.tenant_id)
        .where(
            Operation.status == OpStatus.FAILED,
            Operation.finished_at >= now - FAILED_OPS_WINDOW,
        )
        .order_by(Operation.finished_at.desc(), Operation.id)
        .limit(FAILED_OPS_SHOWN)
    ).all()
    return [
        FailedOp(op_id, tenant, kind, code, category, message or "", finished)
        for op_id, tenant, kind, code, category, message, finished in found
    ]


def fleet_view(db: OrmSession, now: datetime) -> Fleet:
    """The workers that run or still hold queued ops, and the latest departures."""
    return Fleet(workers=fleet.workers(db, now, shown_only=True), departures=departures(db, now))


def departures(db: OrmSession, now: datetime) -> list[Departure]:
    """The latest `DEPARTURES_SHOWN` workers that left (drained or stopped) or were declared
    dead in the last day, latest first; when a dead worker's lease lapsed stands for when it
    went."""
    gone_at = case(
        (Worker.status == WorkerStatus.LEFT, Worker.left_at), else_=Worker.lease_expires_at
    )
    found = db.execute(
        select(Worker.id, Worker.hostname, Worker.status, gone_at)
        .where(
            Worker.status.in_((WorkerStatus.LEFT, WorkerStatus.DEAD)),
            gone_at >= now - DEPARTURES_WINDOW,
        )
        .order_by(gone_at.desc(), Worker.id.desc())
        .limit(DEPARTURES_SHOWN)
    ).all()
    return [
        Departure(worker_id, hostname, status, _aware(at))
        for worker_id, hostname, status, at in found
    ]


def _aware(moment: datetime) -> datetime:
    """A time read through a bare SQL expression: SQLite gives it back naive, in UTC."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment
