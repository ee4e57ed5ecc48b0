"""A worker group of two CPU ranks (`treadle-server worker --group-size 2`) in a real cluster
(PostgreSQL, Redis, an API replica and beat): serving a model that needs two devices, it shards
its base weights over its ranks, serves a tinker SDK loop as one worker does, and a follower
killed in the middle of a loop ends the whole group, whose run then fails over to a plain
worker, each op billed once; restarted, the group stops cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic import SecretStr
from sqlalchemy import func, select

from billing.tables import UsageEvent
from core.db import Database
from core.settings import Settings
from core.tables import TrainingRun, Worker, WorkerStatus
from scheduler import workers
from tests.builders import TenantFactory, tenant_factory
from tests.cluster import SECRET, Cluster, cluster
from tests.scenarios import scenario
from tests.services import throwaway_database

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

GROUP, SINGLE = "group", "single"
STEPS = 5
# A model folder of the cookbook's tests, served here as if it needed two devices.
BIG = "cookbook/arith-1m"
BIG_FOLDER = Path(__file__).resolve().parents[1] / "cookbook" / "arith-1m"


@pytest.fixture
def running(
    tmp_path: Path, postgres_admin_url: str, redis_url: str
) -> Iterator[tuple[Cluster, Database, TenantFactory]]:
    with (
        throwaway_database(postgres_admin_url) as db_url,
        cluster(
            tmp_path, db_url, redis_url, worker_lease_seconds="3", snapshot_every_steps="2"
        ) as group,
    ):
        _start_group(group)
        group.start_api("a1")
        group.start_beat()
        database = Database(db_url)
        _wait_live(database, GROUP)
        settings = Settings(database_url=db_url, server_secret=SecretStr(SECRET))
        yield group, database, tenant_factory(database, settings)


def _start_group(group: Cluster) -> None:
    # A model folder that needs both ranks' devices: the group shards its base weights (every
    # model it serves, the tiny one of the loop too) over its two ranks.
    group.workers[GROUP] = group.spawn(
        GROUP,
        *("worker", "--device", "cpu", "--group-size", "2", "--worker-id", GROUP),
        *("--models", "treadle/tiny-1m", "--models", BIG),
        env={
            "TREADLE_MODEL_FOLDERS": json.dumps({BIG: str(BIG_FOLDER)}),
            "TREADLE_MODEL_DEVICES": json.dumps({BIG: 2}),
        },
    )


def _wait_live(database: Database, worker_id: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with database.transaction() as db:
            if any(w.id == worker_id for w in workers.live(db, datetime.now(UTC))):
                return
        time.sleep(0.2)
    raise AssertionError(f"worker {worker_id} never came up")


def _rank_pids(group: Cluster) -> list[int]:
    """The ranks of the group's latest start."""
    found = re.findall(r"worker group \S+: ranks \[(\d+), (\d+)\]", group.log(GROUP))
    assert found, group.log(GROUP)[-3000:]
    return [int(pid) for pid in found[-1]]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_group_trains_as_one_worker_and_a_killed_follower_fails_the_run_over(
    running: tuple[Cluster, Database, TenantFactory],
) -> None:
    group, database, make_tenant = running
    url = group.api_urls["a1"]
    held: list[str | None] = []

    def holder(step: int, run_id: str) -> None:
        with database.reader() as db:
            held.append(db.scalar(select(TrainingRun.worker_id).where(TrainingRun.id == run_id)))

    with database.reader() as db:
        registered = db.get(Worker, GROUP)
        assert registered is not None and registered.group_size == 2
    assert "loaded base model treadle/tiny-1m on cpu, sharded over 2 ranks" in group.log(GROUP)
    # The group alone serves the model, so it holds the run for the whole loop.
    undisturbed = scenario(url, make_tenant().key, STEPS, on_step=holder)
    assert held == [GROUP] * STEPS

    tenant = make_tenant()
    ranks = _rank_pids(group)
    killed: dict[str, object] = {}

    def kill_follower(step: int, run_id: str) -> None:
        if step == 0:
            group.start_worker(SINGLE)  # the run's next home, up while the loop goes on
        if step != 2:
            return
        _wait_live(database, SINGLE)
        os.kill(ranks[1], signal.SIGKILL)
        # The parent ends the whole group: rank 0 stops renewing its lease, and beat moves
        # the run to the single worker.
        killed["status"] = group.workers[GROUP].wait(timeout=30)
        killed["run"] = run_id

    failed_over = scenario(url, tenant.key, STEPS, on_step=kill_follower)
    assert killed["status"] not in (0, None)
    assert not any(_alive(pid) for pid in ranks)
    assert "rank 1 ended (signal 9); stopping the group" in group.log(GROUP)
    with database.reader() as db:
        new_holder = db.scalar(select(TrainingRun.worker_id).where(TrainingRun.id == killed["run"]))
        per_op_kind = db.execute(
            select(UsageEvent.operation_id, UsageEvent.kind, func.count())
            .where(UsageEvent.tenant_id == tenant.tenant_id)
            .group_by(UsageEvent.operation_id, UsageEvent.kind)
        ).all()
    assert new_holder == SINGLE
    assert per_op_kind and all(count == 1 for _, _, count in per_op_kind)

    # The same loop on the single worker alone: what one engine computes.
    single = scenario(url, make_tenant().key, STEPS)
    assert undisturbed == pytest.approx(single, rel=1e-6)
    assert failed_over == pytest.approx(single, rel=1e-6)

    # Restarted under its id, as its supervisor does, the group stops cleanly on SIGTERM to its
    # first process: rank 0 hands over and leaves, every rank exits, and so does the command.
    _start_group(group)
    _wait_live(database, GROUP)
    ranks = _rank_pids(group)
    os.kill(group.workers[GROUP].pid, signal.SIGTERM)
    assert group.workers[GROUP].wait(timeout=60) == 0, group.log(GROUP)[-3000:]
    assert not any(_alive(pid) for pid in ranks)
    with database.reader() as db:
        stopped = db.get(Worker, GROUP)
        assert stopped is not None and stopped.status == WorkerStatus.LEFT
