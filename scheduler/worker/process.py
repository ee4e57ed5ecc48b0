"""A worker process: one engine on one device, consuming its own Celery queue.

Besides Celery wake-ups it polls the database now and then (a lost message costs a poll, not
an operation), renews its lease, and frees runs whose sessions ended.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid

from celery.signals import worker_shutting_down

from core import liveness
from core.clock import SystemClock
from core.db import Database
from core.objectstore import open_store
from core.settings import Settings
from scheduler.celery_app import make_celery, worker_queue
from scheduler.notify import RedisNotifier
from scheduler.worker.celery_tasks import install_host, register_tasks

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0


def default_worker_id(device: str) -> str:
    return f"{socket.gethostname()}-{device.replace(':', '')}-{uuid.uuid4().hex[:6]}"


def run_worker(settings: Settings, *, worker_id: str, models: list[str]) -> None:
    from scheduler.worker.host import start_host

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

    def keep_lease() -> None:
        # Its own thread, so long engine work never lets the lease lapse.
        while not stop.wait(settings.worker_lease_seconds / 3):
            try:
                alive = host.renew_lease()
            except Exception:
                log.exception("could not renew the lease; retrying")
                continue
            if not alive:
                # Its runs were moved elsewhere: running them here too would fork them.
                log.error("worker %s was declared dead (lease lost); exiting", worker_id)
                os._exit(3)
            liveness.touch(settings.liveness_file)

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
                "--loglevel",
                "INFO",
            ]
        )
    finally:
        stop.set()
        # Samples in flight are queued again now, rather than once this worker's lease lapses.
        host.close()
