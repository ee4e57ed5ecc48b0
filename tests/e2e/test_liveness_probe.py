"""Liveness of real worker and beat processes, as the compose healthchecks and the chart's exec
probes see it: each keeps its TREADLE_LIVENESS_FILE fresh while it runs, `treadle-server probe`
passes on both, and once beat is killed its file goes stale and the probe says so while the
worker's is renewed."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.cluster import CLI, Cluster, cluster
from tests.services import throwaway_database

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

MAX_AGE = "30"


def spawn(group: Cluster, name: str, alive: Path, *args: str) -> subprocess.Popen[bytes]:
    return group.spawn(name, *args, env={"TREADLE_LIVENESS_FILE": str(alive)})


def probe(alive: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CLI, "probe", "--file", str(alive), "--max-age", MAX_AGE],
        capture_output=True,
        text=True,
        timeout=60,
    )


def wait_until_probe_passes(group: Cluster, name: str, alive: Path) -> None:
    deadline = time.monotonic() + 180
    while probe(alive).returncode != 0:
        assert time.monotonic() < deadline, f"{name} never touched {alive}:\n{group.log(name)}"
        time.sleep(0.5)


def backdate(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_workers_and_beat_keep_their_liveness_files_fresh_until_they_stop(
    tmp_path: Path, postgres_admin_url: str, redis_url: str
) -> None:
    beat_alive = tmp_path / "run" / "beat-alive"
    worker_alive = tmp_path / "run" / "worker-alive"
    with (
        throwaway_database(postgres_admin_url) as db_url,
        cluster(tmp_path, db_url, redis_url, worker_lease_seconds="3") as group,
    ):
        group.beat = spawn(group, "beat", beat_alive, "beat")
        group.workers["w1"] = spawn(
            group, "w1", worker_alive, "worker", "--device", "cpu", "--worker-id", "w1"
        )
        wait_until_probe_passes(group, "beat", beat_alive)
        wait_until_probe_passes(group, "w1", worker_alive)

        group.kill(group.beat)
        backdate(beat_alive, 120)
        backdate(worker_alive, 120)
        # The worker renews its lease every second and touches its file again; beat is gone.
        wait_until_probe_passes(group, "w1", worker_alive)
        stale = probe(beat_alive)
        assert stale.returncode == 1
        assert stale.stderr.startswith(f"not alive: {beat_alive} was last touched")
