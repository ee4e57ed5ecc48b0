"""Celery tasks: thin adapters from a message to one call into the worker host.

The worker process installs its host with `install_host` before consuming its queue.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from scheduler.celery_app import RUN_READY_TASK

if TYPE_CHECKING:
    from celery import Celery

    from scheduler.worker.host import WorkerHost

log = logging.getLogger(__name__)
_host: WorkerHost | None = None


def install_host(host: WorkerHost) -> None:
    global _host
    _host = host


def register_tasks(app: Celery) -> None:
    @app.task(name=RUN_READY_TASK, ignore_result=True)
    def run_ready(worker_id: str) -> int:
        """Run every operation that is ready on this worker (idempotent: claims are in the DB)."""
        if _host is None or _host.worker_id != worker_id:
            log.warning(
                "message for worker %s reached a process that is not it; ignored", worker_id
            )
            return 0
        return _host.drain()
