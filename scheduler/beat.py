"""Periodic jobs of distributed mode, run by `treadle-server beat` (one instance).

Each job is a plain function of the database, safe to run twice or concurrently: expire silent
sessions, declare workers with lapsed leases dead and move their work, and (re)place and wake
whatever is queued, which also covers lost wake-up messages; billing's periodic jobs
(`billing.jobs`, each at its own interval); op-log retention (`retention`); and artifact
collection (`artifact_gc`).
"""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy import func, select

from billing import jobs as billing_jobs
from core import liveness, runs, sessions
from core.clock import Clock
from core.db import Database
from core.settings import Settings
from core.tables import Operation, OpStatus
from scheduler import artifact_gc, oplog, retention, workers
from scheduler.placement import place

log = logging.getLogger(__name__)


def reap_dead_workers(database: Database, clock: Clock) -> list[str]:
    """Declare workers whose lease lapsed dead, requeue what they were running, unpin their
    runs and samplers (placed again on live workers by `place_queued`)."""
    with database.transaction() as db:
        dead = workers.declare_dead_lapsed(db, clock.now())
        if not dead:
            return []
        oplog.requeue_held_by(db, dead)
        runs.unpin(db, dead)
    log.warning("workers %s stopped renewing their leases; their work moves to live workers", dead)
    return dead


def place_queued(database: Database, settings: Settings, clock: Clock) -> dict[str, set[str]]:
    """Place every target with queued ops; returns worker id → targets to wake it for."""
    now = clock.now()
    wake: dict[str, set[str]] = {}
    with database.transaction() as db:
        targets = set(
            db.scalars(
                select(Operation.target_id).where(Operation.status == OpStatus.QUEUED).distinct()
            )
        )
        for target in sorted(targets):
            worker_id = place(db, settings, now, target)
            if worker_id is not None:
                wake.setdefault(worker_id, set()).add(target)
    return wake


def tick(database: Database, settings: Settings, clock: Clock) -> None:
    from scheduler.celery_app import make_celery
    from scheduler.dispatch import wake_worker

    with database.transaction() as db:
        expired = sessions.expire_idle(db, clock, settings.session_ttl_seconds)
    if expired:
        log.info("expired %d idle sessions", len(expired))
    reap_dead_workers(database, clock)
    wake = place_queued(database, settings, clock)
    if wake:
        celery = make_celery(settings)
        for worker_id in wake:
            wake_worker(celery, worker_id)
    billing_jobs.run_periodic(database, settings, clock)
    retention.run_periodic(database, settings, clock)
    artifact_gc.run_periodic(database, settings, clock)


def log_heartbeat(
    database: Database, clock: Clock, ticks: int, failed: int, seconds: float
) -> None:
    """One line for the operator reading beat's log: that it runs, and what it sees."""
    try:
        with database.reader() as db:
            live = len(workers.live(db, clock.now()))
            queued = db.scalar(
                select(func.count())
                .select_from(Operation)
                .where(Operation.status == OpStatus.QUEUED)
            )
    except Exception as exc:
        seen = f"workers and queue unknown, the database did not answer ({type(exc).__name__})"
    else:
        seen = f"{live} workers live, {queued} ops queued"
    log.info("beat alive: %d ticks in %.0f s (%d failed), %s", ticks, seconds, failed, seen)


def run_beat(
    settings: Settings,
    clock: Clock,
    *,
    interval_seconds: float = 2.0,
    heartbeat_seconds: float = 300.0,
    stop: threading.Event | None = None,
) -> None:
    """Tick every `interval_seconds` until `stop` is set (the process: until it is killed),
    touching the liveness file after each tick and logging a heartbeat every
    `heartbeat_seconds`."""
    database = Database(settings.resolved_database_url)
    stop = stop or threading.Event()
    log.info("beat running every %.1f s", interval_seconds)
    ticks = failed = 0
    since = time.monotonic()
    while True:
        started = time.monotonic()
        ticks += 1
        try:
            tick(database, settings, clock)
        except Exception:
            failed += 1
            log.exception("beat tick failed; retrying next interval")
        # A failed tick is still a live loop: restarting beat would not bring the database back.
        liveness.touch(settings.liveness_file)
        if started - since >= heartbeat_seconds:
            log_heartbeat(database, clock, ticks, failed, time.monotonic() - since)
            ticks = failed = 0
            since = time.monotonic()
        if stop.wait(max(0.0, interval_seconds - (time.monotonic() - started))):
            return
