"""Distributed mode against embedded mode, with real processes on this machine.

Prints one JSON object:
- `tiny_op_rtt_ms`: p50/p90 of an optim_step on a 1M model through API → Redis → worker → back
  (goal p50 ≤ 15 ms), beside `floor_rtt_ms` (a bare HTTP round trip to the same API in the same
  run), `sdk_floor_rtt_ms` (the same op through the SDK against a server that does nothing:
  the client's own cost) and `api_cpu_ms_per_op` (the API process's CPU time per tiny op);
- `sft_tokens_per_s` for distributed and embedded mode and their `ratio` (goal ≥ 0.9), the
  same tinker-SDK loop (forward_backward + optim_step back to back);
- `failover_s`: from kill -9 of the worker holding a run to the completion of that run's next
  op on another worker (goal ≤ 30 s on the tiny model);
- `rolling_restart`: a tinker-SDK loop (forward_backward + optim_step, tiny model) steps while
  each worker in turn is stopped with SIGTERM (it hands its runs over as it exits) and started
  again under its id: the largest gap between two completed steps (goal ≤ 2 s), the typical
  gap, and `failover_over_drain`, how many times longer a kill -9 makes the client wait.

Uses the machine's PostgreSQL and Redis (or starts private ones, like the test suite).
Run: `python bench/distributed.py [--model treadle/tiny-10m] [--steps 6]`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._latency import tiny_op_latency
from bench._server import embedded_server


def _rows(batch: int, seq: int) -> list[list[int]]:
    return [[(131 * b + 7 * t) % 990 + 5 for t in range(seq + 1)] for b in range(batch)]


def sft_tps(base_url: str, key: str, model: str, rows: list[list[int]], steps: int) -> float:
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=base_url, api_key=key)
    trainer = client.create_lora_training_client(base_model=model, rank=16, seed=0).result()
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(r[:-1]),
            loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)},
        )
        for r in rows
    ]
    trainer.forward_backward(data, "cross_entropy").result()
    trainer.optim_step(types.AdamParams()).result()
    start = time.perf_counter()
    futures = []
    for _ in range(steps):
        futures += [
            trainer.forward_backward(data, "cross_entropy"),
            trainer.optim_step(types.AdamParams()),
        ]
    for future in futures:
        future.result()
    elapsed = time.perf_counter() - start
    client.close("success").result(timeout=60)
    return sum(len(r) - 1 for r in rows) * steps / elapsed


def failover(group: object, database: object, base_url: str, key: str) -> float:
    import tinker
    from sqlalchemy import select
    from tinker import types

    from core.tables import TrainingRun

    client = tinker.ServiceClient(base_url=base_url, api_key=key)
    trainer = client.create_lora_training_client(base_model="treadle/tiny-1m", rank=4).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(10, 40))),
        loss_fn_inputs={"target_tokens": list(range(11, 41)), "weights": [1.0] * 30},
    )
    for _ in range(3):
        trainer.forward_backward([datum], "cross_entropy")
        trainer.optim_step(types.AdamParams()).result()
    with database.reader() as db:  # type: ignore[attr-defined]
        holder = db.scalar(select(TrainingRun.worker_id).where(TrainingRun.id == trainer.model_id))
    group.kill(group.workers[holder])  # type: ignore[attr-defined]
    killed = time.monotonic()
    trainer.forward_backward([datum], "cross_entropy").result()
    elapsed = time.monotonic() - killed
    client.close("success").result(timeout=60)
    return elapsed


def rolling_restart(
    group: object, database: object, base_url: str, key: str, models: list[str]
) -> dict[str, float]:
    import itertools
    import os
    import signal
    import statistics
    import threading

    import tinker
    from sqlalchemy import select
    from tinker import types

    from core.tables import Worker

    client = tinker.ServiceClient(base_url=base_url, api_key=key)
    trainer = client.create_lora_training_client(base_model="treadle/tiny-1m", rank=4).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(10, 40))),
        loss_fn_inputs={"target_tokens": list(range(11, 41)), "weights": [1.0] * 30},
    )
    finished: list[float] = []
    done = threading.Event()

    def loop() -> None:
        while not done.is_set():
            trainer.forward_backward([datum], "cross_entropy")
            trainer.optim_step(types.AdamParams()).result()
            finished.append(time.monotonic())

    def status(worker_id: str) -> str | None:
        with database.reader() as db:  # type: ignore[attr-defined]
            return db.scalar(select(Worker.status).where(Worker.id == worker_id))

    for name in group.workers:  # type: ignore[attr-defined]
        while status(name) != "live":
            time.sleep(0.2)
    stepping = threading.Thread(target=loop)
    stepping.start()
    for name in sorted(group.workers):  # type: ignore[attr-defined]
        time.sleep(2)
        os.killpg(group.workers[name].pid, signal.SIGTERM)  # type: ignore[attr-defined]
        group.workers[name].wait(timeout=120)  # type: ignore[attr-defined]
        group.start_worker(name, *models)  # type: ignore[attr-defined]
        while status(name) != "live":
            time.sleep(0.2)
    time.sleep(2)
    done.set()
    stepping.join()
    client.close("success").result(timeout=60)
    gaps = [b - a for a, b in itertools.pairwise(finished)]
    return {"max_gap_s": round(max(gaps), 2), "median_gap_s": round(statistics.median(gaps), 3)}


def main() -> None:
    from core.db import Database
    from core.settings import Settings
    from tests import services
    from tests.builders import tenant_factory
    from tests.cluster import SECRET, cluster
    from tests.services import free_port

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="treadle/tiny-10m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tiny-ops", type=int, default=200, help="round trips measured")
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    os.environ["HOME"] = tempfile.mkdtemp()
    rows = _rows(args.batch, args.seq)
    result: dict[str, object] = {
        "benchmark": "distributed",
        "model": args.model,
        "batch": f"{args.batch}x{args.seq}",
    }

    with embedded_server(free_port(), threads=1, models=[args.model, "treadle/tiny-1m"]) as server:
        embedded_tps = sft_tps(server.url, server.key, args.model, rows, args.steps)
    with (
        services.postgres_server() as pg,
        services.throwaway_database(pg) as db_url,
        services.redis_server() as redis_url,
        cluster(
            Path(tempfile.mkdtemp()),
            db_url,
            redis_url,
            worker_lease_seconds="10",
            models=json.dumps([args.model, "treadle/tiny-1m"]),
        ) as group,
    ):
        models = [args.model, "treadle/tiny-1m"]
        for name in ("w1", "w2"):
            group.start_worker(name, *models)
        api_url = group.start_api("a1")
        group.start_beat()
        database = Database(db_url)
        key = tenant_factory(database, Settings(database_url=db_url, server_secret=SECRET))(
            max_concurrent_sessions=10
        ).key
        distributed_tps = sft_tps(api_url, key, args.model, rows, args.steps)
        latency = tiny_op_latency(api_url, key, group.apis["a1"].pid, args.tiny_ops)
        failover_s = failover(group, database, api_url, key)
        for name, proc in group.workers.items():  # the one failover killed starts again
            if proc.poll() is not None:
                group.start_worker(name, *models)
        restart = rolling_restart(group, database, api_url, key, models)
    result.update(
        {
            **latency,
            "sft_tokens_per_s": {
                "distributed": round(distributed_tps, 1),
                "embedded": round(embedded_tps, 1),
            },
            "ratio": round(distributed_tps / embedded_tps, 3),
            "failover_s": round(failover_s, 1),
            "rolling_restart": {
                **restart,
                "failover_over_drain": round(failover_s / restart["max_gap_s"], 1),
            },
        }
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
