"""Client sessions: create under the tenant's concurrency quota, heartbeat, finish, expire.

A session is *open* while its status is `active` and it has heartbeated within the TTL. Expiry
is applied lazily wherever a session is read (so quotas never depend on a timer having run) and
by a periodic sweep (so expired sessions' runs get unloaded). Unloading is the scheduler's job:
this module only reports which sessions ended.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.orm import Session as OrmSession

from core.clock import Clock
from core.errors import ErrorCode, NotFound, QuotaExceeded, SessionExpired
from core.ids import new_session_id
from core.tables import SamplingSession, Session, SessionKind, SessionStatus, Tenant, TrainingRun


def _stale_before(clock: Clock, ttl_seconds: float) -> datetime:
    return clock.now() - timedelta(seconds=ttl_seconds)


def _expire_stale(
    db: OrmSession, clock: Clock, ttl_seconds: float, tenant_id: str | None
) -> list[str]:
    query = select(Session.id).where(
        Session.status == SessionStatus.ACTIVE,
        Session.last_heartbeat_at < _stale_before(clock, ttl_seconds),
    )
    if tenant_id is not None:
        query = query.where(Session.tenant_id == tenant_id)
    ids = list(db.scalars(query))
    if ids:
        db.execute(
            update(Session)
            .where(Session.id.in_(ids), Session.status == SessionStatus.ACTIVE)
            .values(
                status=SessionStatus.EXPIRED, ended_at=clock.now(), end_reason="heartbeat_timeout"
            )
        )
    return ids


def create_session(
    db: OrmSession,
    clock: Clock,
    *,
    tenant_id: str,
    api_key_id: str | None,
    ttl_seconds: float,
    tags: Sequence[str] = (),
    user_metadata: dict[str, Any] | None = None,
    sdk_version: str | None = None,
    project_id: str | None = None,
    display_name: str | None = None,
) -> Session:
    """Open a session if the tenant is under its concurrent-session limit.

    The caller's transaction serialises the check and the insert (tenant row lock on
    PostgreSQL, the write lock of a write transaction on SQLite), so concurrent calls can never
    overshoot the limit.
    """
    tenant = db.scalar(select(Tenant).where(Tenant.id == tenant_id).with_for_update())
    if tenant is None:
        raise NotFound("tenant not found")
    _expire_stale(db, clock, ttl_seconds, tenant_id)
    open_count = (
        db.scalar(
            select(func.count())
            .select_from(Session)
            .where(
                Session.tenant_id == tenant_id,
                Session.status == SessionStatus.ACTIVE,
                Session.kind == SessionKind.CLIENT,
            )
        )
        or 0
    )
    if open_count >= tenant.max_concurrent_sessions:
        raise QuotaExceeded(
            f"concurrent session limit reached: tenant {tenant.name!r} allows "
            f"{tenant.max_concurrent_sessions} open sessions and {open_count} are open"
            f"{_describe_open(db, clock, tenant_id, open_count)}; end one with "
            "`treadle sessions end ID` (or RestClient.end_session(ID), or close() its "
            f"ServiceClient), let an idle one expire ({int(ttl_seconds)} s without heartbeat), "
            "or ask the operator to raise max_concurrent_sessions"
        )
    now = clock.now()
    session = Session(
        id=new_session_id(),
        tenant_id=tenant_id,
        api_key_id=api_key_id,
        status=SessionStatus.ACTIVE,
        kind=SessionKind.CLIENT,
        tags=list(tags),
        user_metadata=user_metadata,
        sdk_version=sdk_version,
        project_id=project_id,
        display_name=display_name,
        created_at=now,
        last_heartbeat_at=now,
    )
    db.add(session)
    return session


def serving_session(
    db: OrmSession, clock: Clock, *, tenant_id: str, api_key_id: str, ttl_seconds: float
) -> Session:
    """The open session the OpenAI-compatible API samples in for this API key, opened on first
    use and kept alive by each use (a heartbeat); once it expired unused, a new one is opened.
    Serving sessions do not count against the tenant's concurrent-session quota: they hold no
    training run, only sampling sessions.

    The tenant row is locked (PostgreSQL) or the write transaction held (SQLite) while one is
    looked for and opened, so concurrent first requests of a key share one session.
    """
    if db.scalar(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update()) is None:
        raise NotFound("tenant not found")
    session = db.scalar(
        select(Session)
        .where(
            Session.tenant_id == tenant_id,
            Session.api_key_id == api_key_id,
            Session.kind == SessionKind.SERVING,
            Session.status == SessionStatus.ACTIVE,
        )
        .order_by(Session.created_at.desc(), Session.id)
        .limit(1)
    )
    if session is not None:
        _refresh_expiry(session, clock, ttl_seconds)
        if session.status == SessionStatus.ACTIVE:
            session.last_heartbeat_at = clock.now()
            return session
    now = clock.now()
    session = Session(
        id=new_session_id(),
        tenant_id=tenant_id,
        api_key_id=api_key_id,
        status=SessionStatus.ACTIVE,
        kind=SessionKind.SERVING,
        tags=[],
        display_name="OpenAI-compatible API",
        created_at=now,
        last_heartbeat_at=now,
    )
    db.add(session)
    db.flush()
    return session


_LISTED_IN_QUOTA_ERROR = 5


def _describe_open(db: OrmSession, clock: Clock, tenant_id: str, open_count: int) -> str:
    """`: ID (opened 5m07s ago, last heartbeat 3s ago), ...` for a few open sessions, the
    longest silent first (the likeliest to be left over by a process that died)."""
    rows = db.execute(
        select(Session.id, Session.created_at, Session.last_heartbeat_at)
        .where(
            Session.tenant_id == tenant_id,
            Session.status == SessionStatus.ACTIVE,
            Session.kind == SessionKind.CLIENT,
        )
        .order_by(Session.last_heartbeat_at, Session.id)
        .limit(_LISTED_IN_QUOTA_ERROR)
    ).all()
    if not rows:
        return ""
    now = clock.now()
    listed = ", ".join(
        f"{row.id} (opened {_ago(now, row.created_at)} ago, last heartbeat "
        f"{_ago(now, row.last_heartbeat_at)} ago)"
        for row in rows
    )
    more = open_count - len(rows)
    return f": {listed}" + (f" and {more} more (`treadle sessions` lists them)" if more > 0 else "")


def _ago(now: datetime, then: datetime) -> str:
    """A short duration such as `42s`, `5m07s` or `3h12m`."""
    if then.tzinfo is None and now.tzinfo is not None:
        then = then.replace(tzinfo=now.tzinfo)
    seconds = max(0, int((now - then).total_seconds()))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


# Read on every submission: built once, as building it and deriving its cache key cost more
# than running it.
_OWNED = select(Session).where(
    Session.id == bindparam("session_id"), Session.tenant_id == bindparam("tenant_id")
)


def _owned(db: OrmSession, tenant_id: str, session_id: str) -> Session:
    session = db.scalar(_OWNED, {"session_id": session_id, "tenant_id": tenant_id})
    if session is None:
        raise NotFound(f"session {session_id!r} not found; create one with create_session")
    return session


def _refresh_expiry(session: Session, clock: Clock, ttl_seconds: float) -> None:
    if session.status == SessionStatus.ACTIVE and session.last_heartbeat_at < _stale_before(
        clock, ttl_seconds
    ):
        session.status = SessionStatus.EXPIRED
        session.ended_at = clock.now()
        session.end_reason = "heartbeat_timeout"


def _ended_message(session: Session) -> str:
    how = (
        "finished"
        if session.status == SessionStatus.FINISHED
        else "expired after missing heartbeats"
    )
    return f"session {session.id!r} has {how}; start a new session (a new ServiceClient)"


def heartbeat(
    db: OrmSession, clock: Clock, *, tenant_id: str, session_id: str, ttl_seconds: float
) -> Session:
    """Record a sign of life of an open session; an ended one (or one found expired now) is
    returned unchanged: the caller commits, then refuses with `require_open`, so that a lazy
    expiry is kept."""
    session = _owned(db, tenant_id, session_id)
    _refresh_expiry(session, clock, ttl_seconds)
    if session.status == SessionStatus.ACTIVE:
        session.last_heartbeat_at = clock.now()
    return session


def require_open(session: Session) -> None:
    """Refuse work on an ended session (410: the client must start a new one)."""
    if session.status != SessionStatus.ACTIVE:
        raise SessionExpired(_ended_message(session))


def require_active(
    db: OrmSession, clock: Clock, *, tenant_id: str, session_id: str, ttl_seconds: float
) -> Session:
    """The session if it is open; ended and foreign sessions both answer 404 (an ended one
    with code `session_ended`, as its message says)."""
    session = _owned(db, tenant_id, session_id)
    _refresh_expiry(session, clock, ttl_seconds)
    if session.status != SessionStatus.ACTIVE:
        raise NotFound(_ended_message(session), code=ErrorCode.SESSION_ENDED)
    return session


def finish(
    db: OrmSession,
    clock: Clock,
    *,
    tenant_id: str,
    session_id: str,
    reason: str,
    detail: str | None,
    ttl_seconds: float,
) -> Session:
    """End a session. Finishing an ended session is a no-op that keeps the first reason."""
    session = _owned(db, tenant_id, session_id)
    _refresh_expiry(session, clock, ttl_seconds)
    if session.status == SessionStatus.ACTIVE:
        session.status = SessionStatus.FINISHED
        session.ended_at = clock.now()
        session.end_reason = reason
        session.end_detail = detail
    return session


def expire_idle(db: OrmSession, clock: Clock, ttl_seconds: float) -> list[str]:
    """Expire every session silent past the TTL; returns their ids for the caller to clean up."""
    return _expire_stale(db, clock, ttl_seconds, tenant_id=None)


def get_session(
    db: OrmSession, clock: Clock, *, tenant_id: str, session_id: str, ttl_seconds: float
) -> Session:
    session = _owned(db, tenant_id, session_id)
    _refresh_expiry(session, clock, ttl_seconds)
    return session


def list_sessions(
    db: OrmSession,
    *,
    tenant_id: str,
    limit: int,
    offset: int,
    open_within: tuple[Clock, float] | None = None,
) -> list[Session]:
    """The tenant's sessions, newest first; with `open_within=(clock, ttl_seconds)` only the
    open ones (active and heartbeated within the TTL)."""
    query = select(Session).where(Session.tenant_id == tenant_id)
    if open_within is not None:
        clock, ttl_seconds = open_within
        query = query.where(
            Session.status == SessionStatus.ACTIVE,
            Session.last_heartbeat_at >= _stale_before(clock, ttl_seconds),
        )
    return list(
        db.scalars(
            query.order_by(Session.created_at.desc(), Session.id).limit(limit).offset(offset)
        )
    )


def children(db: OrmSession, session_id: str) -> tuple[list[str], list[str]]:
    """Ids of the training runs and sampling sessions created in a session."""
    runs = db.scalars(
        select(TrainingRun.id)
        .where(TrainingRun.session_id == session_id)
        .order_by(TrainingRun.model_seq_id)
    )
    samplers = db.scalars(
        select(SamplingSession.id)
        .where(SamplingSession.session_id == session_id)
        .order_by(SamplingSession.sampling_session_seq_id)
    )
    return list(runs), list(samplers)
