"""The Celery application: Redis as broker, one queue per worker (`gpu.<worker_id>`).

Messages only wake a worker; the operations themselves live in the database, so the settings
favour never running a message twice over never losing one (acknowledged on receipt, no
prefetch, no result backend).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.settings import Settings

if TYPE_CHECKING:
    from celery import Celery

RUN_READY_TASK = "treadle.worker.run_ready"


def worker_queue(worker_id: str) -> str:
    return f"gpu.{worker_id}"


def make_celery(settings: Settings) -> Celery:
    from celery import Celery

    if not settings.redis_url:
        raise ValueError("Celery needs TREADLE_REDIS_URL")
    app = Celery("treadle", broker=settings.redis_url, set_as_current=False)
    app.conf.update(
        task_acks_late=False,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_default_queue="treadle.default",
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": 3600},
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        task_serializer="json",
        accept_content=["json"],
    )
    return app
