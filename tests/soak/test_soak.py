"""Soak: eight tenants train for minutes on a distributed cluster while faults are injected.

Eight honest tenants each repeat a whole loop through the official tinker SDK (SFT steps,
sampling, an RL step, save, resume) behind a load balancer that cuts connections at random,
while a chaos thread kills and restarts workers, sends poison requests from an attacker tenant,
and abandons sessions so that they expire. It ends with every honest loop's losses equal to a
fault-free run's, no operation left running, one ledger row per operation and kind, and the
workers holding no adapter memory once every session has ended.

Run it alone (about ten minutes; `TREADLE_SOAK_SECONDS` sets how long the tenants train):

    ./scripts/test.sh -m soak -s
"""

from __future__ import annotations

import itertools
import json
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from billing.tables import UsageEvent
from core.db import Database
from core.settings import Settings
from core.tables import Operation, Worker
from tests import corpus
from tests.builders import tenant_factory
from tests.cluster import SECRET, FailoverProxy, cluster
from tests.scenarios import MODEL, scenario
from tests.server import start_server
from tests.services import throwaway_database
from treadle.wire import encode_forward_backward_request

pytestmark = [pytest.mark.soak, pytest.mark.e2e, pytest.mark.integration]

TENANTS = 8
SEEDS = (11, 12)
STEPS = 3
DURATION = float(os.environ.get("TREADLE_SOAK_SECONDS", "480"))
DROP_RATE = 0.01
LEASE_SECONDS = 8
SESSION_TTL_SECONDS = 20


def _references(root: Path) -> dict[int, list[float]]:
    """The losses of the loop on a fault-free embedded server, per LoRA seed."""
    server = start_server(root)
    live = next(server)
    try:
        key = live.make_tenant().key
        return {seed: scenario(live.base_url, key, STEPS, seed=seed) for seed in SEEDS}
    finally:
        server.close()


class Chaos:
    """Injects one fault at a time until stopped, and counts what it did."""

    def __init__(self, group: Any, api: str, attacker_key: str, rng: random.Random) -> None:
        self.group, self.api, self.rng = group, api, rng
        self.http = httpx.Client(
            base_url=f"{api}/api/v1", headers={"X-API-Key": attacker_key}, timeout=60
        )
        self.counts: dict[str, int] = {
            "workers_killed": 0,
            "poison_requests": 0,
            "sessions_abandoned": 0,
        }
        self.stop = threading.Event()
        self._seq = iter(range(1, 1 << 30))
        self._run_id = self._attacker_run()

    def _created(self, session_id: str, model_seq_id: int) -> str:
        created = self.http.post(
            "/create_model",
            json={
                "session_id": session_id,
                "model_seq_id": model_seq_id,
                "base_model": MODEL,
                "lora_config": {"rank": 4},
            },
        ).json()
        return str(created["model_id"])

    def _attacker_run(self) -> str:
        session_id = self.http.post("/create_session", json={}).json()["session_id"]
        self._attacker_session = session_id
        return self._created(session_id, 0)

    def run(self) -> None:
        faults: list[Callable[[], None]] = [self.poison, self.kill_worker, self.abandon_session]
        for fault in itertools.cycle(faults):
            if self.stop.wait(self.rng.uniform(3, 8)):
                return
            fault()
            # Keep the attacker's own session alive: its runs must outlive the soak.
            self.http.post("/session_heartbeat", json={"session_id": self._attacker_session})

    def finish(self) -> None:
        self.http.post(
            f"/sessions/{self._attacker_session}/finish", json={"reason": {"type": "success"}}
        )

    def kill_worker(self) -> None:
        name = self.rng.choice(sorted(self.group.workers))
        self.group.kill(self.group.workers[name])
        self.counts["workers_killed"] += 1
        # Back after its lease lapsed (its runs moved away) or before (it takes them back).
        self.stop.wait(self.rng.uniform(2, 2 * LEASE_SECONDS))
        self.group.start_worker(name)

    def poison(self) -> None:
        """Requests the API refuses, and requests only the engine can refuse, sent among the
        honest tenants' work."""
        for request in corpus.poison_requests(self._run_id, self._seq).values():
            self.http.post(
                "/forward_backward",
                content=encode_forward_backward_request(request),
                headers={"Content-Type": "application/x-protobuf"},
            )
            self.counts["poison_requests"] += 1
        self.http.post(
            "/forward_backward",
            content=corpus.zstd_bomb(80 << 20),
            headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"},
        )
        self.counts["poison_requests"] += 1

    def abandon_session(self) -> None:
        """A session with a run that nobody heartbeats: it expires, and its adapter is freed."""
        session_id = self.http.post("/create_session", json={}).json()["session_id"]
        self._created(session_id, 0)
        self.counts["sessions_abandoned"] += 1


def _wait(predicate: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(1)


@pytest.mark.timeout(DURATION + 900)
def test_soak(
    tmp_path_factory: pytest.TempPathFactory, postgres_admin_url: str, redis_url: str
) -> None:
    expected = _references(tmp_path_factory.mktemp("reference"))
    root = tmp_path_factory.mktemp("soak")
    with (
        throwaway_database(postgres_admin_url) as db_url,
        cluster(
            root,
            db_url,
            redis_url,
            worker_lease_seconds=str(LEASE_SECONDS),
            snapshot_every_steps="2",
            session_ttl_seconds=str(SESSION_TTL_SECONDS),
            gap_timeout_seconds="5",
            # Workers die here every half minute or so, far more often than the default of 3
            # interruptions before an operation is given up is meant for: an honest operation
            # caught by three kills of its worker while it waits for its run to be restored
            # would be failed. Poison operations here fail on their content, not by crashing.
            max_op_attempts="10",
        ) as group,
    ):
        group.start_worker("w1")
        group.start_worker("w2")
        apis = [group.start_api("a1"), group.start_api("a2")]
        group.start_beat()
        database = Database(db_url)
        make_tenant = tenant_factory(database, Settings(database_url=db_url, server_secret=SECRET))
        honest = [make_tenant(max_concurrent_sessions=50) for _ in range(TENANTS)]
        attacker = make_tenant(max_concurrent_sessions=200)
        proxy = FailoverProxy(apis, drop_rate=DROP_RATE, seed=1)
        chaos = Chaos(group, apis[0], attacker.key, random.Random(7))
        chaos_thread = threading.Thread(target=chaos.run, name="chaos")

        loops: list[tuple[int, list[float]]] = []
        errors: list[str] = []
        deadline = time.monotonic() + DURATION

        def train(index: int) -> None:
            seed = SEEDS[index % len(SEEDS)]
            while time.monotonic() < deadline:
                try:
                    loops.append((seed, scenario(proxy.url, honest[index].key, STEPS, seed=seed)))
                except Exception as exc:  # a failed honest loop fails the soak
                    errors.append(f"tenant {index}: {type(exc).__name__}: {exc}")
                    return

        started = time.monotonic()
        trainers = [threading.Thread(target=train, args=(i,)) for i in range(TENANTS)]
        chaos_thread.start()
        for thread in trainers:
            thread.start()
        for thread in trainers:
            thread.join()
        chaos.stop.set()
        chaos_thread.join()
        elapsed = time.monotonic() - started

        assert not errors, errors
        mismatched = [
            (seed, losses)
            for seed, losses in loops
            if losses != pytest.approx(expected[seed], rel=1e-4)
        ]
        assert loops and not mismatched, mismatched

        def running_ops() -> int:
            with database.reader() as db:
                return int(
                    db.scalar(
                        select(func.count())
                        .select_from(Operation)
                        .where(Operation.status == "running")
                    )
                    or 0
                )

        _wait(lambda: running_ops() == 0, 120, "operations stayed running")
        chaos.finish()

        def workers_idle() -> bool:
            with database.reader() as db:
                live = db.scalars(select(Worker).where(Worker.status == "live")).all()
                return bool(live) and all(w.held_runs == 0 and w.adapter_bytes == 0 for w in live)

        # Closed sessions free their runs at once; abandoned ones after the TTL and beat's sweep.
        _wait(workers_idle, SESSION_TTL_SECONDS + 120, "workers still hold adapters")
        with database.reader() as db:
            ledger = db.execute(
                select(UsageEvent.operation_id, UsageEvent.kind, func.count()).group_by(
                    UsageEvent.operation_id, UsageEvent.kind
                )
            ).all()
            ops = db.execute(
                select(Operation.status, Operation.error_category, func.count()).group_by(
                    Operation.status, Operation.error_category
                )
            ).all()
            billed_unfinished = db.scalar(
                select(func.count())
                .select_from(UsageEvent)
                .join(Operation, Operation.id == UsageEvent.operation_id)
                .where(Operation.status != "done")
            )
        assert all(count == 1 for _, _, count in ledger)
        assert billed_unfinished == 0  # failed and refused work is never billed
        figures = {
            "seconds": round(elapsed),
            "tenants": TENANTS,
            "honest_loops": len(loops),
            "losses_equal": not mismatched,
            "operations": {f"{status}/{category or '-'}": count for status, category, count in ops},
            "ledger_rows": len(ledger),
            "connections_cut": proxy.dropped,
            **chaos.counts,
        }
        proxy.close()
        print("\nsoak:", json.dumps(figures))
