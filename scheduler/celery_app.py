"""The Celery application: Redis as broker, one queue per worker (`gpu.<worker_id>`).

Messages only wake a worker; the operations themselves live in the database, so the settings
favour never running a message twice over never losing one (acknowledged on receipt, no
prefetch, no result backend). Logging is Treadle's (`core.logs`): Celery's lines go through
the process's handler, in its format.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import TYPE_CHECKING

from core.settings import Settings

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger(__name__)

RUN_READY_TASK = "treadle.worker.run_ready"


def worker_queue(worker_id: str) -> str:
    return f"gpu.{worker_id}"


def make_celery(settings: Settings) -> Celery:
    from celery import Celery
    from celery.signals import setup_logging

    if not settings.redis_url:
        raise ValueError("Celery needs TREADLE_REDIS_URL")
    app = Celery("treadle", broker=settings.redis_url, set_as_current=False)
    # With a receiver on this signal Celery configures no logging of its own (no handler, no
    # level, no task logger that bypasses the root's handler); `core.logs` did it already.
    setup_logging.connect(_keep_treadle_logging, weak=False)
    app.conf.update(
        task_acks_late=False,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_default_queue="treadle.default",
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": 3600},
        # Cancels only late-acknowledged tasks, which Treadle has none of; set, Celery stops
        # warning on every lost broker connection that its default changes in Celery 6.
        worker_cancel_long_running_tasks_on_connection_loss=True,
        worker_send_task_events=False,
        task_serializer="json",
        accept_content=["json"],
    )
    return app


def _keep_treadle_logging(**_: object) -> None:
    """Celery's `setup_logging` receiver: logging stays as the process configured it."""


def warn_if_root() -> None:
    """Before a worker starts: Celery's own warning about running as root gives advice for its
    command line (`--uid`, which `treadle-server worker` has not) and about pickle, which
    Treadle never accepts; this says what applies instead, once."""
    from celery.exceptions import SecurityWarning

    warnings.filterwarnings("ignore", category=SecurityWarning)
    if os.geteuid() == 0:
        log.warning(
            "the worker runs as root; it needs no privileges: run it as an unprivileged user "
            "(Treadle's container images use uid 10001)"
        )
