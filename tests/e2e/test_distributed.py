"""Distributed mode with real processes: two API replicas, two CPU workers and beat, on
PostgreSQL and Redis. The tinker and treadle SDKs' results equal embedded mode's, a worker
killed in the middle of a loop costs the client latency, not errors, each process serves its
own metrics and keeps its liveness file fresh, and the cookbook's recipes run against it as
they do against an embedded server."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import tinker
from sqlalchemy import func, select

import treadle
from billing.tables import UsageEvent
from core.db import Database
from core.settings import DEFAULT_MODELS, Settings
from core.tables import ModelVersion, Operation, OpStatus, Session, TrainingRun, Worker
from scheduler import workers
from scheduler.ops import OpKind
from tests.builders import TenantFactory, tenant_factory
from tests.cluster import CLI, SECRET, Cluster, FailoverProxy, cluster
from tests.e2e.treadle_data import sft_datum
from tests.scenarios import ADAM, BATCH, MODEL, scenario
from tests.scrape import Samples, by, delta, eventually, reachable, scrape
from tests.server import start_server
from tests.services import free_port
from treadle_cookbook import checkpoints as recipe_checkpoints
from treadle_cookbook import metrics as recipe_metrics
from treadle_cookbook.recipes import distill, dpo, kto, math_grpo, sft_chat

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

ARITH_MODEL = "cookbook/arith-1m"
ARITH_FOLDER = Path(__file__).resolve().parents[1] / "cookbook" / "arith-1m"
TEACHER = "treadle/tiny-qwen-1m"  # the distillation recipe's teacher: tiny-1m's tokenizer
METRICS_TOKEN = "metrics-token-0123456789"


@pytest.fixture(scope="module", params=["shared-folder", "s3"])
def running(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    postgres_admin_url: str,
    redis_url: str,
) -> Iterator[tuple[Cluster, Database, TenantFactory]]:
    """The cluster with its artifacts in one folder every process mounts, or in an S3 bucket
    with no folder shared at all."""
    from tests.services import throwaway_database

    root = tmp_path_factory.mktemp("cluster")
    s3 = None
    if request.param == "s3":
        server = request.getfixturevalue("s3_server")
        s3 = (server.bucket(), server.env)
    with (
        throwaway_database(postgres_admin_url) as db_url,
        cluster(
            root,
            db_url,
            redis_url,
            s3=s3,
            metrics_token=METRICS_TOKEN,
            worker_lease_seconds="10",
            snapshot_every_steps="3",
            session_ttl_seconds="30",
            # The cookbook tests' math GRPO model and distillation teacher, served by workers
            # they start.
            models=json.dumps([*DEFAULT_MODELS, ARITH_MODEL, TEACHER]),
            model_folders=json.dumps({ARITH_MODEL: str(ARITH_FOLDER)}),
        ) as group,
    ):
        group.start_worker("w1", env=_observed(root, "w1"))
        group.start_worker("w2", env=_observed(root, "w2"))
        group.start_api("a1")
        group.start_api("a2")
        group.start_beat(env=_observed(root, "beat"))
        database = Database(db_url)
        settings = Settings(database_url=db_url, server_secret=SECRET)
        yield group, database, tenant_factory(database, settings)


def _observed(root: Path, name: str) -> dict[str, str]:
    """A worker's or beat's own metrics port and liveness file, which the tests below read."""
    return {
        "TREADLE_METRICS_PORT": str(free_port()),
        "TREADLE_LIVENESS_FILE": str(root / "run" / f"{name}-alive"),
    }


def _metrics_url(group: Cluster, name: str) -> str:
    return f"http://127.0.0.1:{group.extra_env[name]['TREADLE_METRICS_PORT']}/metrics"


def _liveness_file(group: Cluster, name: str) -> Path:
    return Path(group.extra_env[name]["TREADLE_LIVENESS_FILE"])


ONE_STORE = pytest.mark.parametrize("running", ["shared-folder"], indirect=True)
"""For a test that never reads an artifact back: the cluster with the shared folder is enough."""


@dataclasses.dataclass(frozen=True)
class Embedded:
    """The losses of each scenario on an embedded server, which the cluster's must equal."""

    tinker: dict[int, list[float]]  # `tests.scenarios.scenario`'s, by number of steps
    treadle: list[float]  # `_treadle_scenario`'s


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Embedded:
    server = start_server(tmp_path_factory.mktemp("embedded"))
    live = next(server)
    try:
        return Embedded(
            tinker={
                steps: scenario(live.base_url, live.make_tenant().key, steps) for steps in (3, 8)
            },
            treadle=_treadle_scenario(live.base_url, live.make_tenant().key),
        )
    finally:
        server.close()


def _treadle_scenario(base_url: str, key: str) -> list[float]:
    """The treadle SDK's loop: train, save the state and resume from it with its optimizer,
    then save for sampling and sample."""
    batch = [sft_datum(i, length=16) for i in range(3)]
    with treadle.ServiceClient(base_url=base_url, api_key=key) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, seed=11)
        losses = []
        for _ in range(3):
            fwd = trainer.forward_backward(batch, "cross_entropy")
            trainer.optim_step(treadle.types.AdamParams(learning_rate=5e-3))
            losses.append(fwd.result(timeout=300).metrics["loss:sum"])
        path = trainer.save_state("done").result(timeout=300).path
        resumed = service.create_training_client_from_state_with_optimizer(path)
        losses.append(resumed.forward(batch).result(timeout=300).metrics["loss:sum"])
        sampler = trainer.save_weights_and_get_sampling_client().result(timeout=300)
        prompt = treadle.types.ModelInput.from_ints([15, 16, 17])
        params = treadle.types.SamplingParams(max_tokens=4, seed=3)
        assert len(sampler.sample(prompt, 2, params).result(timeout=300).sequences) == 2
    return losses


def _grown(
    before: list[Samples], after: list[Samples], name: str, *labels: str
) -> dict[tuple[str, ...], int]:
    """What grew between two scrapes of each of several processes, summed over them."""
    total: Counter[tuple[str, ...]] = Counter()
    for earlier, later in zip(before, after, strict=True):
        total.update(delta(earlier, later, name, *labels))
    return {key: value for key, value in total.items() if value}


# The first tests on the shared-folder cluster (pytest keeps the module's order among the tests
# of one cluster) see it as started: both workers and beat alive, no run placed, none moved.


@ONE_STORE
def test_each_process_serves_its_own_metrics(
    running: tuple[Cluster, Database, TenantFactory],
) -> None:
    """The API replica counts what it submitted behind its token and exports no fleet gauges,
    the worker processes count on their metrics ports the ops their hosts recorded, and beat
    serves the fleet's gauges on its own. The counters are compared before and after this
    test's loop, summed over both workers (the run may land on either); the gauges are exact,
    the test running first on its cluster."""
    group, database, make_tenant = running
    worker_urls = [_metrics_url(group, name) for name in ("w1", "w2")]
    beat_url = _metrics_url(group, "beat")
    api = group.api_urls["a1"]
    token = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    eventually(lambda: all(reachable(url) for url in [*worker_urls, beat_url]), seconds=180)
    for name in ("w1", "w2"):
        _wait_for(database, name, lambda w: w.status == "live", seconds=180)
    workers_before = [scrape(url) for url in worker_urls]
    served_before = scrape(f"{api}/metrics", token)
    tenant = make_tenant()

    with treadle.ServiceClient(base_url=api, api_key=tenant.key) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, seed=1)
        batch = [sft_datum(i, length=8 + i) for i in range(2)]
        trainer.forward_backward(batch, "cross_entropy").result()
        trainer.optim_step(treadle.types.AdamParams(learning_rate=1e-3)).result()

        def recorded() -> bool:
            after = [scrape(url) for url in worker_urls]
            finished = _grown(
                workers_before, after, "treadle_ops_finished_total", "kind", "outcome"
            )
            return finished.get(("optim_step", "done")) == 1

        eventually(recorded)
        workers = [scrape(url) for url in worker_urls]
        beat = scrape(beat_url)
        served = scrape(f"{api}/metrics", token)
    with database.reader() as db:
        trained = db.scalar(
            select(func.sum(UsageEvent.quantity)).where(
                UsageEvent.tenant_id == tenant.tenant_id, UsageEvent.kind == "training"
            )
        )

    assert _grown(workers_before, workers, "treadle_ops_finished_total", "kind", "outcome") == {
        ("create_model", "done"): 1,
        ("forward_backward", "done"): 1,
        ("optim_step", "done"): 1,
    }
    assert _grown(workers_before, workers, "treadle_tokens_total", "kind") == {
        ("training",): trained
    }
    assert delta(served_before, served, "treadle_ops_submitted_total", "kind") == {
        ("create_model",): 1,
        ("forward_backward",): 1,
        ("optim_step",): 1,
    }
    # The fleet's gauges come from beat alone.
    assert not by(served, "treadle_fleet_up")
    assert not any(by(worker, "treadle_fleet_up") for worker in workers)
    assert by(beat, "treadle_fleet_up") == {(): 1}
    assert by(beat, "treadle_workers", "status")[("live",)] == 2
    assert by(beat, "treadle_live_training_runs") == {(): 1}
    assert set(by(beat, "treadle_worker_lease_expires_in_seconds", "worker")) == {
        ("w1",),
        ("w2",),
    }
    assert by(beat, "treadle_worker_failovers_total")[()] == 0


def _probe(alive: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CLI, "probe", "--file", str(alive), "--max-age", "30"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _wait_until_probe_passes(group: Cluster, name: str) -> None:
    alive = _liveness_file(group, name)
    deadline = time.monotonic() + 180
    while _probe(alive).returncode != 0:
        assert time.monotonic() < deadline, f"{name} never touched {alive}:\n{group.log(name)}"
        time.sleep(0.5)


def _backdate(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


@ONE_STORE
def test_workers_and_beat_keep_their_liveness_files_fresh_until_they_stop(
    running: tuple[Cluster, Database, TenantFactory],
) -> None:
    """Liveness as the compose healthchecks and the chart's exec probes see it: a worker and
    beat each keep their TREADLE_LIVENESS_FILE fresh while they run, `treadle-server probe`
    passes on both, and once beat is killed its file goes stale and the probe says so while the
    worker's is renewed. Beat is started again for the later tests."""
    group, _, _ = running
    beat_alive, worker_alive = _liveness_file(group, "beat"), _liveness_file(group, "w1")
    _wait_until_probe_passes(group, "beat")
    _wait_until_probe_passes(group, "w1")

    assert group.beat is not None
    group.kill(group.beat)
    _backdate(beat_alive, 120)
    _backdate(worker_alive, 120)
    # The worker renews its lease every few seconds and touches its file again; beat is gone.
    _wait_until_probe_passes(group, "w1")
    stale = _probe(beat_alive)
    assert stale.returncode == 1
    assert stale.stderr.startswith(f"not alive: {beat_alive} was last touched")
    group.start_beat(env=group.extra_env["beat"])
    _wait_until_probe_passes(group, "beat")


@ONE_STORE
def test_treadle_sdk_results_equal_embedded_mode(
    running: tuple[Cluster, Database, TenantFactory], embedded: Embedded
) -> None:
    group, _, make_tenant = running
    actual = _treadle_scenario(group.api_urls["a1"], make_tenant().key)
    assert actual == pytest.approx(embedded.treadle, rel=1e-5)


def test_results_equal_embedded_mode(
    running: tuple[Cluster, Database, TenantFactory],
    embedded: Embedded,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    group, _, make_tenant = running
    key = make_tenant().key
    first = scenario(group.api_urls["a1"], key, 3)
    second = scenario(group.api_urls["a2"], key, 3)
    assert first == pytest.approx(embedded.tinker[3], rel=1e-5)
    assert second == pytest.approx(embedded.tinker[3], rel=1e-5)


@ONE_STORE
def test_oai_streams_the_tokens_a_worker_process_publishes_through_redis(
    running: tuple[Cluster, Database, TenantFactory],
) -> None:
    """A streamed /oai/v1 completion on an API replica gets its text while a worker process
    still generates it (progress through Redis), and the text equals the unstreamed one."""
    group, database, make_tenant = running
    tenant = make_tenant()
    client = openai.OpenAI(
        base_url=f"{group.api_urls['a2']}/oai/v1", api_key=tenant.key, max_retries=0, timeout=300
    )
    asked: dict[str, Any] = {
        "model": MODEL,
        "prompt": "once upon",
        "max_tokens": 300,
        "seed": 4,
        "n": 2,
    }
    for _ in range(120):  # the workers publish the tokenizer once started
        try:
            whole = client.completions.create(**asked)
            break
        except openai.BadRequestError as exc:
            assert "not published yet" in str(exc)
            time.sleep(1)
    else:
        pytest.fail("no worker published the tokenizer in two minutes")
    texts, status = ["", ""], None
    for chunk in client.completions.create(**asked, stream=True):
        for choice in chunk.choices:
            if choice.text and status is None:
                with database.reader() as db:
                    status = db.scalar(
                        select(Operation.status)
                        .where(
                            Operation.tenant_id == tenant.tenant_id,
                            Operation.kind == OpKind.SAMPLE,
                        )
                        .order_by(Operation.created_at.desc())
                        .limit(1)
                    )
            texts[choice.index] += choice.text
    assert status in (OpStatus.QUEUED, OpStatus.RUNNING)
    assert texts == [c.text for c in whole.choices]


@ONE_STORE
def test_many_runs_on_two_workers_keep_order_and_run_each_op_once(
    running: tuple[Cluster, Database, TenantFactory],
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    group, database, make_tenant = running
    tenant = make_tenant(max_concurrent_sessions=10)

    def drive(index: int) -> str:
        api = group.api_urls["a1" if index % 2 else "a2"]
        client = tinker.ServiceClient(base_url=api, api_key=tenant.key)
        trainer = client.create_lora_training_client(base_model=MODEL, rank=2, seed=index).result()
        futures = []
        for _ in range(4):
            futures.append(trainer.forward_backward(BATCH[:1], "cross_entropy"))
            futures.append(trainer.optim_step(ADAM))
        for future in futures:
            future.result(timeout=300)
        client.close("success").result(timeout=60)
        return trainer.model_id

    with ThreadPoolExecutor(max_workers=6) as pool:
        run_ids = list(pool.map(drive, range(6)))
    with database.reader() as db:
        holders = set(db.scalars(select(TrainingRun.worker_id).where(TrainingRun.id.in_(run_ids))))
        ops = db.execute(
            select(
                Operation.target_id,
                Operation.seq_id,
                Operation.attempts,
                Operation.started_at,
                Operation.finished_at,
            ).where(Operation.target_id.in_(run_ids))
        ).all()
    assert holders == {"w1", "w2"}  # placement spread the runs over both workers
    assert len(ops) == 6 * 9
    assert all(attempts == 1 for _, _, attempts, _, _ in ops)  # no op executed twice
    for run_id in run_ids:
        mine = sorted(
            (seq, started, finished)
            for target, seq, _, started, finished in ops
            if target == run_id
        )
        for (_, _, finished), (_, started, _) in itertools.pairwise(mine):
            assert finished <= started  # each op started only after the previous one finished


def test_live_sampling_runs_on_the_runs_worker_and_follows_it_when_that_worker_dies(
    running: tuple[Cluster, Database, TenantFactory],
) -> None:
    """`live:<run id>` samples the run's current weights where the run is held; after that
    worker is killed (kill -9), the next live sample follows the run to the other worker."""
    group, database, make_tenant = running
    prompt = tinker.types.ModelInput.from_ints([11, 12, 13, 14, 15, 16])
    tenant = make_tenant()
    key, tenant_id = tenant.key, tenant.tenant_id
    service = tinker.ServiceClient(base_url=group.api_urls["a1"], api_key=key)
    trainer = service.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
    run_id = trainer.model_id
    trainer.forward_backward(BATCH, "cross_entropy").result(timeout=300)
    trainer.optim_step(ADAM).result(timeout=300)
    live = service.create_sampling_client(model_path=f"tinker://live:{run_id}").result()
    saved_path = trainer.save_weights_for_sampler("step1").result(timeout=300).path
    saved = service.create_sampling_client(model_path=saved_path).result()

    def logprobs(client: tinker.SamplingClient) -> list[float]:
        return [v for v in client.compute_logprobs(prompt).result(timeout=300) if v is not None]

    def live_sample_workers() -> list[str | None]:
        with database.reader() as db:
            sampler = live._sampling_session_id
            return list(
                db.scalars(
                    select(Operation.worker_id)
                    .where(Operation.target_id == sampler)
                    .order_by(Operation.created_at)
                )
            )

    def holder() -> str | None:
        with database.reader() as db:
            return db.scalar(select(TrainingRun.worker_id).where(TrainingRun.id == run_id))

    at_step1 = logprobs(live)
    assert at_step1 == pytest.approx(logprobs(saved), abs=1e-5)
    first = holder()
    assert first in group.workers and live_sample_workers() == [first]

    group.kill(group.workers[first])
    after_kill = logprobs(live)  # waits out the dead worker's lease, then the run moves
    second = holder()
    assert second in group.workers and second != first
    assert live_sample_workers() == [first, second]
    assert after_kill == pytest.approx(at_step1, abs=1e-5)  # the same weights, rebuilt there
    # /oai/v1 samples it there too, through the other API replica.
    answer = httpx.post(
        f"{group.api_urls['a2']}/oai/v1/completions",
        json={"model": f"live:{run_id}", "prompt": prompt.to_ints(), "max_tokens": 2},
        headers={"Authorization": f"Bearer {key}"},
        timeout=300,
    )
    assert answer.status_code == 200, answer.text
    with database.reader() as db:
        served_on = db.scalar(
            select(Operation.worker_id)
            .where(Operation.tenant_id == tenant_id, Operation.kind == OpKind.SAMPLE)
            .order_by(Operation.created_at.desc())
            .limit(1)
        )
    assert served_on == second
    group.start_worker(f"{first}-again")  # the later tests have two workers again
    service.close("success").result(timeout=60)


def test_killed_worker_costs_latency_not_errors(
    running: tuple[Cluster, Database, TenantFactory], embedded: Embedded
) -> None:
    group, database, make_tenant = running
    tenant = make_tenant()
    timings: dict[str, float] = {}

    victim: dict[str, str] = {}

    def kill_holder(step: int, run_id: str) -> None:
        if step == 4:  # the first step after the kill has completed
            timings["resumed"] = time.monotonic()
        if step != 3:
            return
        with database.reader() as db:
            holder = db.scalar(select(TrainingRun.worker_id).where(TrainingRun.id == run_id))
        assert holder in group.workers
        group.kill(group.workers[holder])
        timings["killed"] = time.monotonic()
        victim.update(run=run_id, worker=holder)

    losses = scenario(group.api_urls["a1"], tenant.key, 8, on_step=kill_holder)
    assert losses == pytest.approx(embedded.tinker[8], rel=1e-4)
    with database.reader() as db:
        per_op_kind = db.execute(
            select(UsageEvent.operation_id, UsageEvent.kind, func.count())
            .where(UsageEvent.tenant_id == tenant.tenant_id)
            .group_by(UsageEvent.operation_id, UsageEvent.kind)
        ).all()
        assert all(count == 1 for _, _, count in per_op_kind)
        trained = db.scalar(
            select(func.sum(UsageEvent.quantity)).where(
                UsageEvent.tenant_id == tenant.tenant_id, UsageEvent.kind == "training"
            )
        )
        new_holder = db.scalar(select(TrainingRun.worker_id).where(TrainingRun.id == victim["run"]))
        ops = db.scalar(
            select(func.count()).select_from(Operation).where(Operation.target_id == victim["run"])
        )
        stored = [
            *db.scalars(
                select(ModelVersion.artifact_uri).where(
                    ModelVersion.training_run_id == victim["run"]
                )
            ),
            db.scalar(select(TrainingRun.snapshot_uri).where(TrainingRun.id == victim["run"])),
        ]
    assert new_holder is not None and new_holder != victim["worker"]
    # Each op billed once: 8 SFT steps and one RL step of training tokens, nothing replayed twice.
    sft_tokens = 8 * sum(d.model_input.length for d in BATCH)
    assert trained is not None and sft_tokens < trained < sft_tokens + 100
    assert ops == 1 + 2 * 9 + 2  # create, 9 x (forward_backward + optim_step), 2 saves
    # Saves and snapshots are in the configured store (with S3, no process shares a folder).
    where = group.env["TREADLE_ARTIFACT_URL"]
    assert len(stored) == 3
    assert all(uri is not None and uri.removeprefix("file://").startswith(where) for uri in stored)
    print(
        f"\nkill-to-resumed (worker killed after step 3 until step 4 completed on {new_holder}): "
        f"{timings['resumed'] - timings['killed']:.1f} s"
    )


@ONE_STORE
def test_killed_api_replica_costs_retries_not_results(
    running: tuple[Cluster, Database, TenantFactory],
) -> None:
    """Clients behind a load balancer long-poll through a replica that dies; every future resolves."""
    group, _, make_tenant = running
    victim = group.start_api("a3")
    proxy = FailoverProxy([victim, group.api_urls["a2"]])
    try:
        client = tinker.ServiceClient(base_url=proxy.url, api_key=make_tenant().key)
        trainer = client.create_lora_training_client(base_model=MODEL, rank=4, seed=11).result()
        futures = []
        for step in range(6):
            futures.append(trainer.forward_backward(BATCH, "cross_entropy"))
            futures.append(trainer.optim_step(ADAM))
            if step == 2:
                group.kill(group.apis["a3"])
        results = [future.result(timeout=300) for future in futures]
        assert len(results) == 12
        client.close("success").result(timeout=60)
    finally:
        proxy.close()


@ONE_STORE
def test_beat_expires_silent_sessions_and_workers_free_their_memory(
    running: tuple[Cluster, Database, TenantFactory],
) -> None:
    group, database, make_tenant = running
    tenant = make_tenant(max_concurrent_sessions=1)
    headers = {"X-API-Key": tenant.key}
    api = group.api_urls["a1"]
    with httpx.Client(base_url=f"{api}/api/v1", headers=headers, timeout=60) as http:
        session_id = http.post("/create_session", json={}).json()["session_id"]
        created = http.post(
            "/create_model",
            json={
                "session_id": session_id,
                "model_seq_id": 0,
                "base_model": MODEL,
                "lora_config": {"rank": 8},
            },
        ).json()
        while (
            http.post("/retrieve_future", json={"request_id": created["request_id"]})
            .json()
            .get("type")
            == "try_again"
        ):
            pass
        run_id = created["model_id"]
        with database.reader() as db:
            holder = db.scalar(select(TrainingRun.worker_id).where(TrainingRun.id == run_id))
        # Once the runs of earlier (closed) sessions are evicted, only this run is held.
        held_before = _wait_for(database, holder, lambda w: w.held_runs == 1, seconds=120)
        assert held_before.adapter_bytes > 0
        assert http.post("/create_session", json={}).status_code == 403  # the slot is taken
        # No heartbeats: beat expires the session after the TTL, then the worker frees the run.
        deadline = time.monotonic() + 120
        while _session_status(database, session_id) != "expired":
            assert time.monotonic() < deadline, "beat did not expire the silent session"
            time.sleep(0.5)
        held_after = _wait_for(database, holder, lambda w: w.held_runs == 0, seconds=120)
        assert held_after.adapter_bytes == 0
        assert http.post("/session_heartbeat", json={"session_id": session_id}).status_code == 410
        assert http.post("/create_session", json={}).status_code == 200  # the slot is free again
    print(
        f"\nworker {holder} held {held_before.adapter_bytes} adapter bytes for the run; "
        f"{held_after.adapter_bytes} after its session expired"
    )


def _session_status(database: Database, session_id: str) -> str | None:
    with database.reader() as db:
        return db.scalar(select(Session.status).where(Session.id == session_id))


def _wait_for(
    database: Database, worker_id: str | None, predicate: object, seconds: float = 60
) -> Worker:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with database.reader() as db:
            worker = db.get(Worker, worker_id)
            if worker is not None and callable(predicate) and predicate(worker):
                return worker
        time.sleep(0.5)
    raise AssertionError(f"worker {worker_id} never reached the expected state")


def _live_workers(group: Cluster, database: Database, count: int, model: str = MODEL) -> None:
    """Start workers serving `model` until `count` are live (earlier tests kill some)."""

    def serving() -> list[str]:
        with database.transaction() as db:
            return [
                w.id
                for w in workers.live(db, datetime.now(UTC))
                if any(entry["name"] == model for entry in w.models)
            ]

    for n in range(count - len(serving())):
        group.start_worker(f"extra-{len(group.workers)}-{n}", model)
    deadline = time.monotonic() + 120
    while len(serving()) < count:
        assert time.monotonic() < deadline, f"{count} workers serving {model} never came up"
        time.sleep(0.5)


@ONE_STORE
def test_stopped_worker_hands_its_run_over_at_once(
    running: tuple[Cluster, Database, TenantFactory], embedded: Embedded
) -> None:
    """SIGTERM on the worker holding a run in the middle of a tinker loop: the worker saves the
    run and hands it to the other worker as it exits, so the loop pauses for a restore, not for
    a lease to lapse; the losses are an undisturbed run's and each op is billed once."""
    group, database, make_tenant = running
    _live_workers(group, database, 2)
    tenant = make_tenant()
    finished: list[float] = []
    stopped: dict[str, str] = {}

    def stop_holder(step: int, run_id: str) -> None:
        finished.append(time.monotonic())
        if step != 3:
            return
        with database.reader() as db:
            holder = db.scalar(select(TrainingRun.worker_id).where(TrainingRun.id == run_id))
        assert holder in group.workers
        os.killpg(group.workers[holder].pid, signal.SIGTERM)
        stopped.update(run=run_id, worker=holder)

    losses = scenario(group.api_urls["a1"], tenant.key, 8, on_step=stop_holder)
    assert losses == pytest.approx(embedded.tinker[8], rel=1e-4)
    assert group.workers[stopped["worker"]].wait(timeout=60) == 0
    with database.reader() as db:
        left = db.get(Worker, stopped["worker"])
        assert left is not None and left.status == "left"  # it left; beat declared no one dead
        new_holder = db.scalar(
            select(TrainingRun.worker_id).where(TrainingRun.id == stopped["run"])
        )
        per_op_kind = db.execute(
            select(UsageEvent.operation_id, UsageEvent.kind, func.count())
            .where(UsageEvent.tenant_id == tenant.tenant_id)
            .group_by(UsageEvent.operation_id, UsageEvent.kind)
        ).all()
    assert new_holder not in (None, stopped["worker"])
    assert per_op_kind and all(count == 1 for _, _, count in per_op_kind)
    assert "handed over in" in group.log(stopped["worker"])
    gaps = [b - a for a, b in itertools.pairwise(finished)]
    print(
        f"\nstopped {stopped['worker']} after step 3: largest step gap {max(gaps[3:]):.2f} s "
        f"(steps before the stop: largest {max(gaps[:3]):.2f} s)"
    )


@ONE_STORE
def test_drained_worker_restarted_under_its_id_gets_its_run_back_without_replay(
    running: tuple[Cluster, Database, TenantFactory],
) -> None:
    """`admin workers drain` on the only worker serving a model: the worker saves the run and
    leaves; started again under the same id it takes the run back and restores it from that
    state, replaying nothing, and the loop's losses are an undisturbed run's."""
    group, database, make_tenant = running
    model, name = "treadle/tiny-10m", "only-10m"
    group.start_worker(name, model)
    _wait_for(database, name, lambda w: w.status == "live", seconds=120)
    service = tinker.ServiceClient(base_url=group.api_urls["a2"], api_key=make_tenant().key)

    def steps(trainer: tinker.TrainingClient, count: int) -> list[float]:
        losses = []
        for _ in range(count):
            result = trainer.forward_backward(BATCH, "cross_entropy").result(timeout=300)
            losses.append(result.metrics["loss:sum"])
            trainer.optim_step(ADAM).result(timeout=300)
        return losses

    undisturbed = steps(
        service.create_lora_training_client(base_model=model, rank=4, seed=5).result(), 4
    )
    trainer = service.create_lora_training_client(base_model=model, rank=4, seed=5).result()
    before = steps(trainer, 2)
    drained = subprocess.run(
        [CLI, "admin", "workers", "drain", name],
        env=group.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert drained.returncode == 0, drained.stderr
    assert group.workers[name].wait(timeout=60) == 0
    with database.reader() as db:
        run = db.get(TrainingRun, trainer.model_id)
        left = db.get(Worker, name)
        assert run is not None and left is not None and left.status == "left"
        assert run.worker_id is None and run.snapshot_seq_id == run.executed_seq_id == 4
    group.start_worker(name, model)
    after = steps(trainer, 2)
    assert before + after == pytest.approx(undisturbed, rel=1e-5)
    with database.reader() as db:
        assert (
            db.scalar(select(TrainingRun.worker_id).where(TrainingRun.id == trainer.model_id))
            == name
        )
    assert f"restored {trainer.model_id} from a snapshot and replayed 0 ops" in group.log(name)
    service.close("success").result(timeout=60)


@ONE_STORE
def test_cookbook_recipes_run_unchanged_and_resume_across_replicas(
    running: tuple[Cluster, Database, TenantFactory], tmp_path: Path
) -> None:
    """sft_chat and math_grpo, as they run on an embedded server, against the API replicas: the
    SFT held-out loss falls over a run stopped at step 2 and continued through the other
    replica from its checkpoint, and GRPO trains the arithmetic model (served by a worker given
    its folder) on groups whose rewards differ."""
    group, database, make_tenant = running
    _live_workers(group, database, 1)
    group.start_worker("arith", ARITH_MODEL)
    key = make_tenant().key
    sft_dir = tmp_path / "sft"
    sft = ["--api_key", key, "--log_dir", str(sft_dir), "--lora_rank", "8", "--eval_every", "2"]
    sft_chat.main([*sft, "--base_url", group.api_urls["a1"], "--steps", "2"])
    sft_chat.main([*sft, "--base_url", group.api_urls["a2"], "--steps", "4"])
    assert [c["step"] for c in recipe_checkpoints.read(sft_dir)] == [2, 4]
    rows = recipe_metrics.read(sft_dir)
    assert [r["step"] for r in rows if "train_loss" in r] == [1, 2, 3, 4]
    held_out = [(r["step"], r["held_out_loss"]) for r in rows if "held_out_loss" in r]
    assert [step for step, _ in held_out] == [0, 2, 4] and held_out[-1][1] < held_out[0][1]

    _wait_for(database, "arith", lambda w: w.status == "live", seconds=120)
    grpo_dir = tmp_path / "grpo"
    math_grpo.main(
        [
            "--base_url", group.api_urls["a2"], "--api_key", key, "--model", ARITH_MODEL,
            "--log_dir", str(grpo_dir), "--steps", "3", "--groups_per_step", "4",
            "--group_size", "4", "--minibatches", "2", "--eval_problems", "20",
            "--lora_rank", "8",
        ]
    )  # fmt: skip
    rows = recipe_metrics.read(grpo_dir)
    steps = [r for r in rows if "reward" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert any(r.get("advantage_abs_mean", 0.0) > 0 for r in steps), steps
    assert [r["step"] for r in rows if "held_out_accuracy" in r] == [0, 3]
    assert recipe_checkpoints.read(grpo_dir)[-1]["step"] == 3


@ONE_STORE
def test_cookbook_preference_and_distillation_recipes_train_through_the_replicas(
    running: tuple[Cluster, Database, TenantFactory], tmp_path: Path
) -> None:
    """dpo and kto, whose loss the client computes (`forward_backward_custom`), raise the train
    margin from exactly zero through one replica, and distill, whose targets are the teacher's
    top-K logprobs (sampled by a worker serving the teacher) as 2-D cross-entropy targets,
    lowers the student's KL to the teacher through the other."""
    group, database, make_tenant = running
    _live_workers(group, database, 1)
    group.start_worker("teacher", TEACHER)  # starts while the preference recipes train
    key = make_tenant().key
    for recipe in (dpo, kto):
        log_dir = tmp_path / recipe.__name__.rsplit(".", 1)[-1]
        recipe.main(
            [
                "--base_url", group.api_urls["a1"], "--api_key", key, "--log_dir", str(log_dir),
                "--steps", "4", "--eval_every", "4",
            ]
        )  # fmt: skip
        rows = recipe_metrics.read(log_dir)
        margins = [(r["step"], r["train_margin"]) for r in rows if "train_margin" in r]
        assert [step for step, _ in margins] == [0, 4], margins
        # The reference is the run's initial weights, so the margin starts at exactly zero.
        assert margins[0][1] == 0.0 and margins[-1][1] > 0.0, (recipe.__name__, margins)

    _wait_for(database, "teacher", lambda w: w.status == "live", seconds=120)
    distill_dir = tmp_path / "distill"
    distill.main(
        [
            "--base_url", group.api_urls["a2"], "--api_key", key, "--teacher_model", TEACHER,
            "--log_dir", str(distill_dir), "--steps", "4", "--eval_every", "4",
        ]
    )  # fmt: skip
    rows = recipe_metrics.read(distill_dir)
    held_out = [(r["step"], r["held_out_kl"]) for r in rows if "held_out_kl" in r]
    assert [step for step, _ in held_out] == [0, 4] and held_out[1][1] < held_out[0][1], held_out
    kl = [r["kl"] for r in rows if "kl" in r]
    assert len(kl) == 4 and kl[-1] < kl[0], kl
