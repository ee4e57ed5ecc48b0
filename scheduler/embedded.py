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
        from scheduler.worker_host import start_host

        return start_host(
            settings,
            database,
            clock,
            store,
            notifier,
            worker_id="embedded",
            models=settings.models,
            distributed=False,
        )

    return EmbeddedDispatcher(build_host)
