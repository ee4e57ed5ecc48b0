"""Metrics in distributed mode, from real processes: the API replica counts what it submitted
behind its token and exports no fleet gauges, the worker process counts on its metrics port the
ops its host recorded, and beat serves the fleet's gauges on its own."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from sqlalchemy import func, select

import treadle
from billing.tables import UsageEvent
from core.db import Database
from core.settings import Settings
from tests.builders import tenant_factory
from tests.cluster import SECRET, Cluster, cluster
from tests.e2e.treadle_data import MODEL, sft_datum
from tests.scrape import by, eventually, reachable, scrape
from tests.services import free_port, throwaway_database
from treadle import types

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

TOKEN = "metrics-token-0123456789"


def spawn(group: Cluster, name: str, port: int, *args: str) -> subprocess.Popen[bytes]:
    return group.spawn(name, *args, env={"TREADLE_METRICS_PORT": str(port)})


def test_each_process_serves_its_own_metrics(
    tmp_path: Path, postgres_admin_url: str, redis_url: str
) -> None:
    worker_port, beat_port = free_port(), free_port()
    with (
        throwaway_database(postgres_admin_url) as db_url,
        cluster(tmp_path, db_url, redis_url, metrics_token=TOKEN) as group,
    ):
        group.workers["w1"] = spawn(
            group, "w1", worker_port, "worker", "--device", "cpu", "--worker-id", "w1"
        )
        group.beat = spawn(group, "beat", beat_port, "beat")
        api = group.start_api("a1")
        worker_url = f"http://127.0.0.1:{worker_port}/metrics"
        beat_url = f"http://127.0.0.1:{beat_port}/metrics"
        eventually(lambda: reachable(worker_url) and reachable(beat_url), seconds=180)
        database = Database(db_url)
        key = tenant_factory(database, Settings(database_url=db_url, server_secret=SECRET))().key

        with treadle.ServiceClient(base_url=api, api_key=key) as service:
            trainer = service.create_lora_training_client(MODEL, rank=4, seed=1)
            batch = [sft_datum(i, length=8 + i) for i in range(2)]
            trainer.forward_backward(batch, "cross_entropy").result()
            trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()

            def recorded() -> bool:
                finished = by(scrape(worker_url), "treadle_ops_finished_total", "kind", "outcome")
                return finished[("optim_step", "done")] == 1

            eventually(recorded)
            worker = scrape(worker_url)
            beat = scrape(beat_url)
            served = scrape(f"{api}/metrics", {"Authorization": f"Bearer {TOKEN}"})
        with database.reader() as db:
            trained = db.scalar(
                select(func.sum(UsageEvent.quantity)).where(UsageEvent.kind == "training")
            )

    assert by(worker, "treadle_ops_finished_total", "kind", "outcome") == {
        ("create_model", "done"): 1,
        ("forward_backward", "done"): 1,
        ("optim_step", "done"): 1,
    }
    assert by(worker, "treadle_tokens_total", "kind") == {("training",): trained}
    assert by(served, "treadle_ops_submitted_total", "kind") == {
        ("create_model",): 1,
        ("forward_backward",): 1,
        ("optim_step",): 1,
    }
    # The fleet's gauges come from beat alone.
    assert not by(served, "treadle_fleet_up") and not by(worker, "treadle_fleet_up")
    assert by(beat, "treadle_fleet_up") == {(): 1}
    assert by(beat, "treadle_workers", "status")[("live",)] == 1
    assert by(beat, "treadle_live_training_runs") == {(): 1}
    assert set(by(beat, "treadle_worker_lease_expires_in_seconds", "worker")) == {("w1",)}
    assert by(beat, "treadle_worker_failovers_total")[()] == 0
