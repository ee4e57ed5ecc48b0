"""The fleet's gauges, read from the database at each scrape: sessions, live runs, queued ops
and what each worker holds and how long its lease has left.

The numbers are the database's, the same from any process, so exactly one process exports
them: the embedded server on its `/metrics`, and in distributed mode `treadle-server beat` (one
instance) on its metrics port; the API replicas do not, so no query has to dedupe them. Each
scrape reads them in one read transaction: sessions, runs and workers counted by status, the
queue grouped by target (`scheduler.fleet.queued_by_worker`, which then reads where each target
with queued ops is placed) and the shown workers' rows (`scheduler.fleet.workers`). The queue's
count uses its (status, target) index; sessions and runs are counted by a scan of their tables,
whose status is indexed only after the tenant, so a scrape costs more as they accumulate. On
PostgreSQL the gauges read on a connection of their own with a statement timeout: scrapes that
pile up wait for that one connection, or fail, and never take beat's. Per-worker series exist
for workers that are live or draining, or that still have queued ops, so dead and departed
workers' rows never grow the series.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select, text

from core import runs
from core.clock import Clock
from core.db import Database
from core.logs import Outage
from core.tables import Session, SessionStatus, TrainingRun, Worker, WorkerStatus
from scheduler import fleet

log = logging.getLogger(__name__)

# A scrape's longest wait: for the gauges' one connection, and for each of its statements.
SCRAPE_TIMEOUT_SECONDS = 5


class FleetGauges(Collector):
    """The fleet's gauges as a prometheus_client collector: each `collect()` (one scrape) reads
    them in one read transaction, and reports `treadle_fleet_up` 0 without them when the
    database does not answer. `close()` releases its connection."""

    def __init__(self, database: Database, clock: Clock) -> None:
        """`database` is the process's; on PostgreSQL the gauges open their own pool of one
        connection to it."""
        self.database = (
            database
            if database.is_sqlite
            else Database(
                database.url, pool_size=1, max_overflow=0, pool_timeout=SCRAPE_TIMEOUT_SECONDS
            )
        )
        self._own = self.database is not database
        self.clock = clock
        self._reading = Outage(
            log, "reading the fleet gauges", "scrapes report treadle_fleet_up 0 until it works"
        )

    def close(self) -> None:
        if self._own:
            self.database.dispose()

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "treadle_fleet_up",
            "1 when the fleet gauges below were read from the database at this scrape, 0 when "
            "the database did not answer (the gauges are then absent).",
        )
        try:
            gauges = self._read()
        except Exception as exc:
            self._reading.failed(exc)
            up.add_metric([], 0)
            yield up
            return
        self._reading.succeeded()
        up.add_metric([], 1)
        yield up
        yield from gauges

    def _read(self) -> list[Metric]:
        now = self.clock.now()
        with self.database.reader() as db:
            if not self.database.is_sqlite:
                db.execute(text(f"SET LOCAL statement_timeout = {SCRAPE_TIMEOUT_SECONDS * 1000}"))
            sessions = db.scalar(
                select(func.count())
                .select_from(Session)
                .where(Session.status == SessionStatus.ACTIVE)
            )
            live_runs = db.scalar(
                select(func.count())
                .select_from(TrainingRun)
                .where(TrainingRun.status.in_(runs.HOLDING))
            )
            statuses = dict(
                db.execute(select(Worker.status, func.count()).group_by(Worker.status)).all()
            )
            queued = fleet.queued_by_worker(db)
            workers = fleet.workers(db, now, queued=queued, shown_only=True)
        by_status = GaugeMetricFamily(
            "treadle_workers", "Registered workers by status.", labels=["status"]
        )
        for status in WorkerStatus:
            by_status.add_metric([status.value], statuses.get(status.value, 0))
        queued_on = GaugeMetricFamily(
            "treadle_worker_queued_ops",
            "Operations queued for the runs and samplers placed on each worker.",
            labels=["worker"],
        )
        adapter = GaugeMetricFamily(
            "treadle_worker_adapter_bytes",
            "Bytes of adapter and optimizer state each worker's engine held at its last lease "
            "renewal.",
            labels=["worker"],
        )
        lease = GaugeMetricFamily(
            "treadle_worker_lease_expires_in_seconds",
            "Seconds until each worker's lease lapses (negative: lapsed that long ago; beat then "
            "declares it dead).",
            labels=["worker"],
        )
        for w in workers:
            queued_on.add_metric([w.worker_id], w.queued_ops)
            adapter.add_metric([w.worker_id], w.adapter_bytes)
            lease.add_metric([w.worker_id], w.lease_expires_in_seconds)
        return [
            GaugeMetricFamily(
                "treadle_active_sessions", "Client sessions open now.", value=sessions or 0
            ),
            GaugeMetricFamily(
                "treadle_live_training_runs",
                "Training runs pending or active (not unloaded, not failed).",
                value=live_runs or 0,
            ),
            GaugeMetricFamily(
                "treadle_unplaced_queued_ops",
                "Queued operations whose run or sampler is placed on no worker yet.",
                value=queued.get(None, 0),
            ),
            by_status,
            queued_on,
            adapter,
            lease,
        ]
