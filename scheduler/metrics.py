"""Prometheus metrics of the scheduler's processes: what the worker host recorded, the workers
beat declared dead, and the metrics port that workers and beat serve them on.

Each process keeps its own counts in prometheus_client's default registry and serves them
itself (one Python process per port, so prometheus_client's multiprocess mode is not needed).
Ops are observed after the transaction that records them commits, in whichever process runs
the host (the embedded server, or each worker), so a rolled-back record is never counted and
every recorded op is counted exactly once. The database-derived fleet gauges are
`scheduler.fleet_gauges`; the API's own metrics are `api.metrics`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from datetime import datetime
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from billing.ledger import UsageLine
from core.errors import ConfigurationError
from core.settings import Settings
from core.tables import Operation, OpStatus
from scheduler.fleet_gauges import FleetGauges
from scheduler.oplog import Finished

log = logging.getLogger(__name__)

# The ledger's kinds counted in tokens (checkpoints and storage are not).
TOKEN_KINDS = ("training", "sampling_prefill", "sampling_sample")

# From a few milliseconds to ten minutes: an HTTP request, long-polls included.
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
# The same up to an hour: an op may wait that long for a worker.
OP_SECONDS_BUCKETS = (*LATENCY_BUCKETS, 1800.0, 3600.0)

OPS_FINISHED = Counter(
    "treadle_ops_finished_total",
    "Operations recorded by this process's worker host, by kind and outcome (done or failed; "
    "category user or server for a failure, empty when done).",
    ["kind", "outcome", "category"],
)
QUEUE_WAIT = Histogram(
    "treadle_op_queue_wait_seconds",
    "From an operation's submission to its (last) start on a worker, by kind.",
    ["kind"],
    buckets=OP_SECONDS_BUCKETS,
)
EXECUTION = Histogram(
    "treadle_op_execution_seconds",
    "From an operation's (last) start on a worker to its recorded result, by kind.",
    ["kind"],
    buckets=OP_SECONDS_BUCKETS,
)
END_TO_END = Histogram(
    "treadle_op_end_to_end_seconds",
    "From an operation's submission to its recorded result, by kind.",
    ["kind"],
    buckets=OP_SECONDS_BUCKETS,
)
TOKENS = Counter(
    "treadle_tokens_total",
    "Tokens of the operations this process recorded, by usage ledger kind (training, "
    "sampling_prefill, sampling_sample): the quantities written to usage_events.",
    ["kind"],
)
FAILOVERS = Counter(
    "treadle_worker_failovers_total",
    "Workers this beat process declared dead because their lease lapsed (their runs move to "
    "live workers); counted by beat as it declares them, from 0 at beat's start.",
    registry=None,  # beat's alone: other processes declare no one dead (`beat_registry`)
)


@dataclasses.dataclass(frozen=True)
class RecordedOp:
    """What the metrics need of an op just recorded, read while its transaction is open."""

    kind: str
    failed_category: str | None
    """user or server for a failed op; None for a done one."""
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime
    tokens: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, op: Operation | Finished, usage: Iterable[UsageLine]) -> RecordedOp:
        assert op.finished_at is not None, "only a recorded op is observed"
        failed = op.status == OpStatus.FAILED
        return cls(
            kind=op.kind,
            failed_category=(op.error_category or "server") if failed else None,
            created_at=op.created_at,
            started_at=op.started_at,
            finished_at=op.finished_at,
            tokens=tuple(
                (line.kind, line.quantity)
                for line in usage
                if line.kind in TOKEN_KINDS and line.quantity > 0
            ),
        )

    @property
    def queue_wait_seconds(self) -> float | None:
        """From submission to the (last) start; None for an op that never started."""
        return None if self.started_at is None else _seconds(self.created_at, self.started_at)

    @property
    def execution_seconds(self) -> float | None:
        """From the (last) start to the recorded result; None for an op that never started."""
        return None if self.started_at is None else _seconds(self.started_at, self.finished_at)

    @property
    def end_to_end_seconds(self) -> float:
        return _seconds(self.created_at, self.finished_at)


def _seconds(start: datetime, end: datetime) -> float:
    # The API's and the worker's clocks may differ a little: never a negative duration.
    return max((end - start).total_seconds(), 0.0)


def observe_recorded(op: RecordedOp) -> None:
    """Count an op whose record committed: its outcome, its latencies and its tokens."""
    if op.failed_category is None:
        OPS_FINISHED.labels(op.kind, "done", "").inc()
    else:
        OPS_FINISHED.labels(op.kind, "failed", op.failed_category).inc()
    if op.queue_wait_seconds is not None and op.execution_seconds is not None:
        QUEUE_WAIT.labels(op.kind).observe(op.queue_wait_seconds)
        EXECUTION.labels(op.kind).observe(op.execution_seconds)
    END_TO_END.labels(op.kind).observe(op.end_to_end_seconds)
    for kind, quantity in op.tokens:
        TOKENS.labels(kind).inc(quantity)


def count_failovers(dead: int) -> None:
    FAILOVERS.inc(dead)


class Forward(Collector):
    """Yields another registry's metrics, so a registry of one app can hold the process's
    (the default registry's) beside its own collectors."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        return self._registry.collect()


def registry_with(*collectors: Collector) -> CollectorRegistry:
    """A registry serving this process's metrics and `collectors`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Forward(REGISTRY))
    for collector in collectors:
        registry.register(collector)
    return registry


def beat_registry(gauges: FleetGauges) -> CollectorRegistry:
    """What beat serves: its process's metrics, its failover count and the fleet's gauges
    (beat is the one distributed process exporting them)."""
    return registry_with(FAILOVERS, gauges)


def serve_port(settings: Settings, registry: CollectorRegistry = REGISTRY) -> WSGIServer | None:
    """Serve `registry` on TREADLE_METRICS_PORT (bound to TREADLE_METRICS_HOST, no token) from
    a daemon thread; None when no port is set. `shutdown()` on the server stops it."""
    if settings.metrics_port is None:
        return None
    try:
        server, _ = start_http_server(
            settings.metrics_port, addr=settings.metrics_host, registry=registry
        )
    except OSError as exc:
        raise ConfigurationError(
            f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port} ({exc}); "
            "set TREADLE_METRICS_PORT to a free port (each process on a host needs its own) and "
            "TREADLE_METRICS_HOST to an address of this host"
        ) from exc
    log.info("metrics served on http://%s:%d/metrics", settings.metrics_host, settings.metrics_port)
    return server


def stop_port(server: WSGIServer | None) -> None:
    """Stop serving a metrics port `serve_port` started, and free the port."""
    if server is not None:
        server.shutdown()
        server.server_close()
