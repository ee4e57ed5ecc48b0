"""Billing's periodic jobs, run by whichever loop a deployment has: the embedded server's
periodic task, or `treadle-server beat` in distributed mode.

`run_periodic` may be called as often as the loop ticks: each job runs when its interval has
passed since it last ran in this process. Every job is idempotent, so a second process running
them (two beats during a hand-over, a restart) changes nothing.
"""

from __future__ import annotations

import logging

from billing.storage import meter_storage
from billing.stripe_push import start_push
from core.clock import Clock
from core.db import Database
from core.periodic import due
from core.settings import Settings

log = logging.getLogger(__name__)


def meter_storage_now(database: Database, clock: Clock) -> int:
    """Meter checkpoint storage for every ended hour not yet metered; returns the events
    written."""
    with database.transaction() as db:
        metered = meter_storage(db, clock)
    if metered:
        log.info("metered checkpoint storage: %d tenant-hours", len(metered))
    return len(metered)


def tick_seconds(settings: Settings) -> float:
    """How often a loop should call `run_periodic`: the shortest job interval."""
    return min(settings.storage_meter_seconds, settings.stripe_push_seconds)


def run_periodic(database: Database, settings: Settings, clock: Clock) -> None:
    """Run the billing jobs that are due. A job that fails is logged and retried at its next
    interval; it never stops the others."""
    now = clock.now()
    if due("storage", database, now, settings.storage_meter_seconds):
        try:
            meter_storage_now(database, clock)
        except Exception:
            log.exception("metering checkpoint storage failed; retrying next interval")
    if settings.stripe_api_key is not None and due(
        "stripe", database, now, settings.stripe_push_seconds
    ):
        # In a thread of its own: Stripe's backoff never delays the loop's other jobs.
        start_push(database, settings, clock)
