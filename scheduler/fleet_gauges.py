"""The fleet's gauges, read from the database at each scrape: sessions, live runs, queued ops
and what each worker holds and how long its lease has left.

The numbers are the database's, the same from any process, so exactly one process exports
them: the embedded server on its `/metrics`, and in distributed mode `treadle-server beat` (one
instance) on its metrics port; the API replicas do not, so no query has to dedupe them. Each
scrape runs a handful of indexed aggregate queries (`scheduler.fleet.workers` among them);
per-worker series exist for workers that are live or draining, or that still have queued ops,
so dead and departed workers' rows never grow the series.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from core import runs
from core.clock import Clock
from core.db import Database
from core.tables import Operation, OpStatus, Session, SessionStatus, TrainingRun, WorkerStatus
from scheduler import fleet

log = logging.getLogger(__name__)

# Workers shown one by one: those that run, or still have work placed on them.
SHOWN = (WorkerStatus.LIVE, WorkerStatus.DRAINING)


class FleetGauges(Collector):
    def __init__(self, database: Database, clock: Clock) -> None:
        self.database = database
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "treadle_fleet_up",
            "1 when the fleet gauges below were read from the database at this scrape, 0 when "
            "the database did not answer (the gauges are then absent).",
        )
        try:
            gauges = self._read()
        except Exception as exc:
            log.warning("fleet gauges unavailable: %s: %s", type(exc).__name__, exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from gauges

    def _read(self) -> list[Metric]:
        now = self.clock.now()
        with self.database.reader() as db:
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
            queued = db.scalar(
                select(func.count())
                .select_from(Operation)
                .where(Operation.status == OpStatus.QUEUED)
            )
            workers = fleet.workers(db, now)
        by_status = GaugeMetricFamily(
            "treadle_workers", "Registered workers by status.", labels=["status"]
        )
        for status in WorkerStatus:
            by_status.add_metric([status.value], sum(w.status == status for w in workers))
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
        placed = 0
        for w in workers:
            placed += w.queued_ops
            if w.status not in SHOWN and not w.queued_ops:
                continue
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
                value=(queued or 0) - placed,
            ),
            by_status,
            queued_on,
            adapter,
            lease,
        ]
