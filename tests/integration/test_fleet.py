"""The fleet views, on each database: one scripted cluster (two live workers, one whose lease
lapsed, a run no live worker can take, a run with a seq_id gap, a claimed op), read through
`scheduler.fleet` and through `treadle-server admin runs|workers|ops --stuck`; and beat's
warnings about work it cannot place."""

from __future__ import annotations

import logging
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from api.cli import app
from core import sessions
from core.clock import FakeClock
from core.settings import Settings
from scheduler import fleet, oplog
from scheduler.beat import UnplacedTargets, place_queued, reap_dead_workers
from scheduler.placement import place
from tests.builders import make_settings
from tests.scheduling import MODEL, Rows, migrated

pytestmark = pytest.mark.integration

ORPHAN = "nobody/serves-this"
LAPSING = "lapsing/model"
ELAPSED = 100.0  # seconds between building the cluster and reading it
HOUR = 3600.0


@pytest.fixture
def settings(tmp_path: Path, database_url: str) -> Settings:
    return make_settings(tmp_path, database_url)


@pytest.fixture
def rows(database_url: str) -> Rows:
    # Near the real time, so that the CLI (which reads the system clock) sees the same leases.
    start = datetime.now(UTC) - timedelta(seconds=ELAPSED)
    return Rows(migrated(database_url), FakeClock(start.replace(microsecond=0)))


class Cluster:
    """The scripted fleet; built at the clock's start, read ELAPSED seconds later."""

    def __init__(self, rows: Rows, settings: Settings) -> None:
        self.rows = rows
        rows.worker("w-a", [MODEL], lease_seconds=HOUR)
        rows.worker("w-b", [MODEL], lease_seconds=HOUR)
        rows.worker("w-lapsing", [LAPSING], lease_seconds=5)
        self.acme, self.globex = rows.tenant(), rows.tenant()

        self.busy = rows.run(self.acme)  # its op 1 runs on w-a, op 2 waits behind it
        self.gapped = rows.run(self.globex)  # seq_id 1 never arrives
        self.orphan = rows.run(self.acme, base_model=ORPHAN)
        self.stranded = rows.run(self.globex, base_model=LAPSING)
        self.ended = rows.run(self.acme)
        placed = [self._place(settings, r) for r in (self.busy, self.gapped, self.stranded)]
        assert placed == ["w-a", "w-b", "w-lapsing"]
        assert self._place(settings, self.orphan) is None

        for run in (self.busy, self.gapped, self.stranded, self.ended):
            rows.executed(run, 0)  # created
        self.running = rows.training_op(self.busy, 1).request_id
        with rows.database.transaction() as db:
            claimed, _ = oplog.claim(
                db,
                oplog.ReadyQueries.build("w-a"),
                worker_id="w-a",
                now=rows.clock.now(),
                max_attempts=3,
                max_samples=0,
            )
        assert [r.op.id for r in claimed] == [self.running]
        self.behind = rows.training_op(self.busy, 2).request_id
        self.after_gap = rows.training_op(self.gapped, 2).request_id
        self.stranded_op = rows.training_op(self.stranded, 1).request_id
        # Samples of the stranded run's current weights run where the run is; samples of the
        # base model wait for beat to place their sampler.
        self.following = rows.sampler(
            self.globex, base_model=LAPSING, training_run_id=self.stranded
        )
        self.following_sample = rows.sample_op(self.following, 0)
        self.base_sampler = rows.sampler(self.acme)
        self.base_sample = rows.sample_op(self.base_sampler, 0)
        self.orphan_create = rows.ops(self.orphan)[0].id
        with rows.database.transaction() as db:
            ended = rows.training_run(self.ended)
            sessions.finish(
                db,
                rows.clock,
                tenant_id=self.acme,
                session_id=ended.session_id,
                reason="user",
                detail=None,
                ttl_seconds=HOUR,
            )

        rows.clock.advance(ELAPSED)
        # Recent: not stuck yet at the 60 s the views are read with.
        self.recent = rows.training_op(self.orphan, 1).request_id

    def _place(self, settings: Settings, target: str) -> str | None:
        with self.rows.database.transaction() as db:
            return place(db, settings, self.rows.clock.now(), target)


@pytest.fixture
def cluster(rows: Rows, settings: Settings) -> Cluster:
    return Cluster(rows, settings)


def test_runs_lists_the_usable_runs_with_where_they_are(cluster: Cluster) -> None:
    now = cluster.rows.clock.now()
    with cluster.rows.database.reader() as db:
        listed = {r.run_id: r for r in fleet.runs(db, now)}
        by_tenant = {r.run_id for r in fleet.runs(db, now, tenant=cluster.globex)}
        on_b = {r.run_id for r in fleet.runs(db, now, worker="w-b")}
    # The run whose session ended is not listed.
    assert set(listed) == {cluster.busy, cluster.gapped, cluster.orphan, cluster.stranded}
    busy = listed[cluster.busy]
    assert (busy.worker_id, busy.lora_rank, busy.base_model) == ("w-a", 2, MODEL)
    assert busy.tenant_id == cluster.acme and busy.tenant_name.startswith("tenant-")
    assert busy.ops_in_flight == 2  # op 1 running, op 2 queued
    assert busy.last_op_age_seconds == ELAPSED
    orphan = listed[cluster.orphan]
    assert (orphan.worker_id, orphan.status, orphan.ops_in_flight) == (None, "pending", 2)
    assert orphan.last_op_age_seconds == 0.0  # its op 1 was just submitted
    assert by_tenant == {cluster.gapped, cluster.stranded}
    assert on_b == {cluster.gapped}


def test_workers_lists_leases_placed_runs_and_queued_work(cluster: Cluster) -> None:
    with cluster.rows.database.reader() as db:
        listed = {w.worker_id: w for w in fleet.workers(db, cluster.rows.clock.now())}
    assert list(listed) == ["w-a", "w-b", "w-lapsing"]
    a, b, lapsing = listed["w-a"], listed["w-b"], listed["w-lapsing"]
    assert (a.status, a.lease_expires_in_seconds, a.runs_placed, a.queued_ops) == (
        "live",
        HOUR - ELAPSED,
        1,
        1,  # op 2 of its run; op 1 runs
    )
    assert (b.runs_placed, b.queued_ops, b.device, b.group_size) == (1, 1, "cpu", 1)
    # Lapsed, not yet declared dead by beat: still "live", its lease 95 s past.
    assert (lapsing.status, lapsing.lease_expires_in_seconds) == ("live", 5 - ELAPSED)
    assert (lapsing.runs_placed, lapsing.queued_ops) == (1, 2)  # with the live sampler's
    assert a.runs_reported == 0 and a.adapter_bytes == 0  # nothing renewed a lease yet


def test_stuck_ops_say_why_each_waits(cluster: Cluster, settings: Settings) -> None:
    with cluster.rows.database.reader() as db:
        stuck = {op.op_id: op for op in fleet.stuck_ops(db, cluster.rows.clock.now(), settings, 60)}
    reasons = {op_id: op.reason for op_id, op in stuck.items()}
    assert reasons == {
        cluster.running: f"running on w-a for {ELAPSED:.0f} s",
        cluster.behind: "behind seq_id 1, running",
        cluster.after_gap: (
            "waiting for seq_id 1, never submitted (skipped once a later op has waited 120 s)"
        ),
        cluster.stranded_op: f"worker w-lapsing not alive; no live worker serves {LAPSING}",
        cluster.following_sample: (f"worker w-lapsing not alive; no live worker serves {LAPSING}"),
        cluster.base_sample: "not placed yet (beat places queued work every few seconds)",
        cluster.orphan_create: f"no live worker serves {ORPHAN}",
    }
    assert cluster.recent not in stuck
    assert stuck[cluster.running].status == "running"
    assert stuck[cluster.after_gap].seq_id == 2
    assert all(op.waited_seconds == ELAPSED for op in stuck.values())

    with cluster.rows.database.reader() as db:
        everything = fleet.stuck_ops(db, cluster.rows.clock.now(), settings, 0)
    recent = next(op for op in everything if op.op_id == cluster.recent)
    assert recent.reason == (f"no live worker serves {ORPHAN}; behind seq_id 0, queued")


def _cli(database_url: str, *args: str) -> str:
    result = CliRunner().invoke(
        app, list(args), env={"TREADLE_DATABASE_URL": database_url, "COLUMNS": "60"}
    )
    assert result.exit_code == 0, result.output
    return result.stdout


def test_the_admin_commands_show_the_same(cluster: Cluster, database_url: str) -> None:
    runs = _cli(database_url, "admin", "runs")
    for run in (cluster.busy, cluster.gapped, cluster.orphan, cluster.stranded):
        assert run in runs, runs  # whole, though the terminal is narrow
    assert cluster.ended not in runs and "…" not in runs
    globex = _cli(database_url, "admin", "runs", "--tenant", "tenant-1")
    assert cluster.gapped in globex and cluster.busy not in globex
    on_a = _cli(database_url, "admin", "runs", "--worker", "w-a")
    assert cluster.busy in on_a and cluster.gapped not in on_a

    workers = _cli(database_url, "admin", "workers")
    assert "ranks" in workers, workers
    assert re.search(r"w-lapsing .* live .* lapsed \d+ s ago", workers), workers
    assert re.search(r"w-a .* live .* expires in 5\d min", workers), workers

    stuck = _cli(database_url, "admin", "ops", "--stuck")
    for op_id in (cluster.running, cluster.behind, cluster.after_gap, cluster.stranded_op):
        assert op_id in stuck, stuck
    assert f"no live worker serves {ORPHAN}" in stuck and "waiting for seq_id 1" in stuck
    assert cluster.recent not in stuck
    assert cluster.recent in _cli(database_url, "admin", "ops", "--stuck", "--older-than", "0")


def test_an_unknown_tenant_and_a_missing_stuck_flag_are_refused(
    cluster: Cluster, database_url: str
) -> None:
    env = {"TREADLE_DATABASE_URL": database_url}
    unknown = CliRunner().invoke(app, ["admin", "runs", "--tenant", "nobody"], env=env)
    assert unknown.exit_code == 2 and "no tenant named 'nobody'" in unknown.stderr
    bare = CliRunner().invoke(app, ["admin", "ops"], env=env)
    assert bare.exit_code == 2 and "pass --stuck" in bare.stderr


def _scheduler_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The scheduler's records among those captured: a thread another test left behind (a
    tinker SDK client's heartbeat) may log meanwhile."""
    return [r for r in caplog.records if r.name.startswith("scheduler.")]


def test_beat_says_where_a_dead_workers_work_goes_and_warns_once_per_unplaced_target(
    cluster: Cluster, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="scheduler.beat")
    unplaced = UnplacedTargets()
    rows = cluster.rows
    assert reap_dead_workers(rows.database, settings, rows.clock, unplaced) == ["w-lapsing"]
    assert f"no live worker for {LAPSING}" in caplog.text and cluster.stranded in caplog.text
    assert "move to" not in caplog.text

    caplog.clear()
    for _ in range(3):  # beat's ticks
        place_queued(rows.database, settings, rows.clock, unplaced)
    warned = sorted(r.getMessage() for r in _scheduler_lines(caplog))
    # The stranded run was reported by the reaper already; the orphan and the sampler following
    # the stranded run (a target of its own) once each, on the first tick; the base sampler
    # was placed.
    assert warned == sorted(
        f"cannot place {target}: no live worker serves {model}; its queued ops wait until one "
        "registers"
        for target, model in ((cluster.orphan, ORPHAN), (cluster.following, LAPSING))
    )

    caplog.clear()
    rows.worker("w-c", [MODEL, ORPHAN, LAPSING], lease_seconds=HOUR)
    wake = place_queued(rows.database, settings, rows.clock, unplaced)
    assert wake["w-c"] == {cluster.orphan, cluster.stranded, cluster.following}
    assert not _scheduler_lines(caplog)

    rows.clock.advance(2 * HOUR)  # every lease lapses; w-d serves one of the models
    rows.worker("w-d", [MODEL], lease_seconds=HOUR)
    reap_dead_workers(rows.database, settings, rows.clock, unplaced)
    said = [r.getMessage().split("declared dead; ", 1)[1] for r in _scheduler_lines(caplog)]
    assert sorted(said) == sorted(
        [
            f"its 2 runs and samplers of {MODEL} move to live workers serving it (w-d)",  # w-a
            f"its 1 runs and samplers of {MODEL} move to live workers serving it (w-d)",  # w-b
            f"no live worker for {ORPHAN}, so its 1 runs and samplers of it wait "
            f"({cluster.orphan})",
            f"no live worker for {LAPSING}, so its 2 runs and samplers of it wait "
            f"({', '.join(sorted([cluster.following, cluster.stranded]))})",
        ]
    )
    caplog.clear()
    wake = place_queued(rows.database, settings, rows.clock, unplaced)
    assert wake == {"w-d": {cluster.busy, cluster.gapped, cluster.base_sampler}}
    assert not _scheduler_lines(caplog)  # the reaper said why the others wait
