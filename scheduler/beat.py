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
from collections import OrderedDict

from sqlalchemy import select
from sqlalchemy.orm import Session as OrmSession

from billing import jobs as billing_jobs
from core import liveness, runs, sessions
from core.clock import Clock
from core.db import Database
from core.settings import Settings
from core.tables import Operation, OpStatus, SamplingSession, TrainingRun
from scheduler import artifact_gc, fleet, metrics, oplog, retention, workers
from scheduler.fleet_gauges import FleetGauges
from scheduler.placement import live_servers, place

log = logging.getLogger(__name__)


class UnplacedTargets:
    """Warns that a target cannot be placed once, not on every tick: it remembers the targets
    already reported. Bounded: past `limit` the oldest are forgotten (and warned about again
    if still unplaced). A target is forgotten once placed, so a second outage warns again."""

    def __init__(self, limit: int = 10_000) -> None:
        self._reported: OrderedDict[str, None] = OrderedDict()
        self._limit = limit

    def warn(self, target_id: str, reason: str) -> None:
        """Log that `target_id` cannot be placed, and why, unless that was reported already."""
        if self.mark(target_id):
            log.warning(
                "cannot place %s: %s; its queued ops wait until one registers", target_id, reason
            )

    def mark(self, target_id: str) -> bool:
        """Count `target_id` as reported (another message said so); False if it was already."""
        if target_id in self._reported:
            return False
        self._reported[target_id] = None
        if len(self._reported) > self._limit:
            self._reported.popitem(last=False)
        return True

    def placed(self, target_id: str) -> None:
        self._reported.pop(target_id, None)


def _unplaced_reason(db: OrmSession, target_id: str) -> str:
    """Why `placement.place` found no worker for a target with queued ops."""
    run = db.get(TrainingRun, target_id)
    sampler = None if run is not None else db.get(SamplingSession, target_id)
    if sampler is not None and runs.is_live(sampler):
        run = db.get(TrainingRun, sampler.training_run_id)  # its samples run where the run is
    model = run.base_model if run is not None else sampler.base_model if sampler else None
    if model is None:
        return "its training run or sampler no longer exists"
    return f"no live worker serves {model}"


def _held_by(db: OrmSession, worker_ids: list[str]) -> list[tuple[str, str, str]]:
    """(target, worker, base model) of the live runs placed on these workers, and of their
    samplers with work in flight."""
    run_rows = db.execute(
        select(TrainingRun.id, TrainingRun.worker_id, TrainingRun.base_model).where(
            TrainingRun.worker_id.in_(worker_ids), TrainingRun.status.in_(runs.HOLDING)
        )
    ).all()
    busy = select(Operation.target_id).where(Operation.status.in_(oplog.IN_FLIGHT))
    sampler_rows = db.execute(
        select(SamplingSession.id, SamplingSession.worker_id, SamplingSession.base_model).where(
            SamplingSession.worker_id.in_(worker_ids), SamplingSession.id.in_(busy)
        )
    ).all()
    return [
        (target, worker, model)
        for target, worker, model in [*run_rows, *sampler_rows]
        if worker is not None
    ]


def reap_dead_workers(
    database: Database,
    settings: Settings,
    clock: Clock,
    unplaced: UnplacedTargets | None = None,
) -> list[str]:
    """Declare workers whose lease lapsed dead, requeue what they were running, unpin their
    runs and samplers (placed again on live workers by `place_queued`). Logs, per dead worker
    and base model, which live workers serve the model (where its work goes), or that none
    does: those targets wait, and `place_queued` does not warn about them again."""
    unplaced = unplaced if unplaced is not None else UnplacedTargets()
    now = clock.now()
    with database.transaction() as db:
        dead = workers.declare_dead_lapsed(db, now)
        if not dead:
            return []
        held: dict[tuple[str, str], list[str]] = {}
        for target_id, worker_id, model in _held_by(db, dead):
            held.setdefault((worker_id, model), []).append(target_id)
        oplog.requeue_held_by(db, dead)
        runs.unpin(db, dead)
        servers = {
            model: [w.id for w in live_servers(db, settings, now, model)] for _, model in held
        }
    for worker_id in dead:
        if not any(holder == worker_id for holder, _ in held):
            log.warning(
                "worker %s stopped renewing its lease: declared dead; it held nothing", worker_id
            )
    for (worker_id, model), targets in sorted(held.items()):
        if servers[model]:
            log.warning(
                "worker %s stopped renewing its lease: declared dead; its %d runs and samplers "
                "of %s move to live workers serving it (%s)",
                worker_id,
                len(targets),
                model,
                ", ".join(servers[model]),
            )
            continue
        for target_id in targets:
            unplaced.mark(target_id)
        log.warning(
            "worker %s stopped renewing its lease: declared dead; no live worker for %s, so its "
            "%d runs and samplers of it wait (%s)",
            worker_id,
            model,
            len(targets),
            ", ".join(sorted(targets)),
        )
    return dead


def place_queued(
    database: Database,
    settings: Settings,
    clock: Clock,
    unplaced: UnplacedTargets | None = None,
) -> dict[str, set[str]]:
    """Place every target with queued ops; returns worker id → targets to wake it for. A
    target that cannot be placed is warned about once (`unplaced` remembers it) with why."""
    unplaced = unplaced if unplaced is not None else UnplacedTargets()
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
                unplaced.placed(target)
                wake.setdefault(worker_id, set()).add(target)
            else:
                # The run or sampler is in the session already (place read it): cheap to ask.
                unplaced.warn(target, _unplaced_reason(db, target))
    return wake


def tick(
    database: Database,
    settings: Settings,
    clock: Clock,
    unplaced: UnplacedTargets | None = None,
) -> None:
    """One round of every periodic job; `unplaced` carries what was warned about between
    rounds (without it, each round warns afresh)."""
    from scheduler.celery_app import make_celery
    from scheduler.dispatch import wake_worker

    with database.transaction() as db:
        expired = sessions.expire_idle(db, clock, settings.session_ttl_seconds)
    if expired:
        log.info("expired %d idle sessions", len(expired))
    unplaced = unplaced if unplaced is not None else UnplacedTargets()
    metrics.count_failovers(len(reap_dead_workers(database, settings, clock, unplaced)))
    wake = place_queued(database, settings, clock, unplaced)
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
            queued = fleet.queued_by_worker(db)
    except Exception as exc:
        seen = f"workers and queue unknown, the database did not answer ({type(exc).__name__})"
    else:
        seen = (
            f"{live} workers live, {sum(queued.values())} ops queued "
            f"({queued.get(None, 0)} on no worker yet)"
        )
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
    touching the liveness file as it starts and after each tick, and logging a heartbeat every
    `heartbeat_seconds`."""
    database = Database(settings.resolved_database_url)
    unplaced = UnplacedTargets()
    stop = stop or threading.Event()
    gauges = FleetGauges(database, clock)
    metrics_port = metrics.serve_port(settings, metrics.beat_registry(gauges))
    log.info("beat running every %.1f s", interval_seconds)
    # Alive from the start: the first tick runs every periodic job at once and may be long.
    liveness.touch(settings.liveness_file)
    ticks = failed = 0
    since = time.monotonic()
    while True:
        started = time.monotonic()
        ticks += 1
        try:
            tick(database, settings, clock, unplaced)
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
            metrics.stop_port(metrics_port)
            gauges.close()
            return
