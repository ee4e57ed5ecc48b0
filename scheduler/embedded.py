"""Embedded mode's dispatcher: the engine on a thread of the API process."""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.clock import Clock
from core.db import Database
from core.objectstore import ArtifactStore
from core.settings import Settings
from scheduler.dispatch import EmbeddedDispatcher
from scheduler.notify import Notifier

if TYPE_CHECKING:
    from scheduler.worker_host import WorkerHost


def embedded_dispatcher(
    settings: Settings, database: Database, clock: Clock, notifier: Notifier, store: ArtifactStore
) -> EmbeddedDispatcher:
    def build_host() -> WorkerHost:
        # Imported here, on the engine thread: the API process must not load torch at import.
        from scheduler.worker_host import WorkerHost, build_engine

        engine = build_engine(settings)
        host = WorkerHost(
            database,
            clock,
            engine,
            store,
            notifier,
            worker_id="embedded",
            gap_timeout_seconds=settings.gap_timeout_seconds,
            snapshot_every_steps=settings.snapshot_every_steps,
            max_attempts=settings.max_op_attempts,
            max_request_bytes=settings.max_request_bytes,
        )
        host.register(settings.models, store)
        return host

    return EmbeddedDispatcher(build_host)
