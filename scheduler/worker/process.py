"""A worker process: one engine on one device, consuming its own Celery queue.

Besides Celery wake-ups it polls the database now and then (a lost message costs a poll, not
an operation), renews its lease, and frees runs whose sessions ended.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING

from celery.signals import worker_shutting_down

from core import liveness
from core.clock import SystemClock
from core.db import Database
from core.objectstore import open_store
from core.settings import Settings
from core.tables import WorkerStatus
from scheduler import artifact_cache, metrics
from scheduler.celery_app import make_celery, worker_queue
from scheduler.notify import RedisNotifier
from scheduler.worker.celery_tasks import install_host, register_tasks

if TYPE_CHECKING:
    from celery import Celery

    from scheduler.worker.host import WorkerHost

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0


def default_worker_id(device: str) -> str:
    return f"{socket.gethostname()}-{device.replace(':', '')}-{uuid.uuid4().hex[:6]}"


def run_worker(settings: Settings, *, worker_id: str, models: list[str]) -> None:
    from scheduler.worker.host import start_host

    # Until the engine is loaded and the lease renewed, the probe must fail.
    liveness.forget(settings.liveness_file)
    # What this worker's host records (`scheduler.metrics`). Bound first: a port taken stops
    # the worker before it registers, so beat never counts it as a failover.
    metrics.serve_port(settings)
    clock = SystemClock()
    database = Database(settings.resolved_database_url)
    store = open_store(settings)
    assert settings.redis_url is not None
    notifier = RedisNotifier(settings.redis_url)
    host = start_host(
        settings,
        database,
        clock,
        store,
        notifier,
        worker_id=worker_id,
        models=models,
        distributed=True,
    )
    install_host(host)
    stop = threading.Event()
    # The lease is renewed until the hand-over is done: a lapse in between would let beat move
    # the runs while this worker still saves them.
    lease_done = threading.Event()
    draining, leaving = threading.Event(), threading.Event()

    def keep_lease() -> None:
        # Its own thread, so long engine work never lets the lease lapse.
        while not lease_done.wait(settings.worker_lease_seconds / 3):
            try:
                status = host.renew_lease()
            except Exception:
                log.exception("could not renew the lease; retrying")
                continue
            if status is WorkerStatus.LEFT and leaving.is_set():
                return  # the hand-over has marked it left
            if status in (None, WorkerStatus.DEAD, WorkerStatus.LEFT):
                # Its runs were moved elsewhere (or another process under its id left):
                # running them here too would fork them.
                log.error("worker %s is %s in the database; exiting", worker_id, status or "gone")
                os._exit(3)
            liveness.touch(settings.liveness_file)
            if status is WorkerStatus.DRAINING and not draining.is_set():
                # Asked to drain (`treadle-server admin workers drain`): stop as on SIGTERM,
                # which hands the runs over on the way out.
                draining.set()
                log.info("worker %s asked to drain; stopping", worker_id)
                os.kill(os.getpid(), signal.SIGTERM)

    def poll() -> None:
        while not stop.wait(POLL_SECONDS):
            try:
                host.drain()
            except Exception:
                log.exception("worker poll failed; continuing")

    def stop_claiming(**_: object) -> None:
        # Celery's warm shutdown waits for the task in progress: a drain() that, under steady
        # traffic, would step and claim for ever. Stopped, it gives back what is in flight.
        host.stop()

    worker_shutting_down.connect(stop_claiming, weak=False)
    threading.Thread(target=keep_lease, name="treadle-lease", daemon=True).start()
    threading.Thread(target=poll, name="treadle-poll", daemon=True).start()
    # This machine's copies of artifacts: beat, on another machine, cannot remove them.
    cache_job = (stop, database, settings, clock, store)
    threading.Thread(
        target=artifact_cache.keep_trimmed, args=cache_job, name="treadle-cache", daemon=True
    ).start()
    app = make_celery(settings)
    register_tasks(app)
    log.info(
        "worker %s serving %s on %s, queue %s",
        worker_id,
        models,
        host.engine.device,
        worker_queue(worker_id),
    )
    try:
        app.worker_main(
            [
                # No banner: the line above says what this worker serves, and the output stays
                # log lines alone (one JSON object each with TREADLE_LOG_FORMAT=json).
                "--quiet",
                "worker",
                "--pool",
                "solo",
                "--concurrency",
                "1",
                "--queues",
                worker_queue(worker_id),
                "--hostname",
                f"{worker_id}@%h",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ]
        )
    finally:
        stop.set()
        leaving.set()
        hand_over(host, settings, app)
        lease_done.set()


def hand_over(host: WorkerHost, settings: Settings, app: Celery) -> None:
    """Leaving on purpose: finish the step in progress, give back the samples in flight, save
    and unpin the runs, and wake the workers they are placed on, so clients wait for a restore
    rather than for this worker's lease to lapse."""
    from scheduler.dispatch import wake_worker

    started = time.monotonic()
    try:
        wake = host.hand_over(settings)
    except Exception:
        log.exception(
            "handing the runs over failed; they move once this worker's lease lapses instead"
        )
        host.close()
        return
    if wake is None:
        return  # declared dead meanwhile: beat moves the runs
    for target_worker in wake:
        wake_worker(app, target_worker)
    log.info("handed over in %.0f ms", (time.monotonic() - started) * 1000)
