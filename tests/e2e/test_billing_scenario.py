"""Billing holds together in distributed mode, with real processes: two tenants linked to Stripe
customers train, sample and save on two base models through the tinker SDK over two API
replicas and two workers; a price changes between two phases of the loop, a worker is killed
in the middle of it, a request is delivered twice and a worker woken twice. Afterwards the
ledger holds one row per op and kind, every event is priced by the version in force at its
time, and the usage API, the tinker SDK's billing usage, the rollups and Stripe's meters (a
fake Stripe, pushed to with a clock past the hour's settle delay) agree to the micro-unit."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from sqlalchemy import func, select
from tinker import types

from billing.pricebook import set_price
from billing.prices import cost_micros, rate_in_force
from billing.rollups import rollup_totals
from billing.spend import period_spend, period_start
from billing.stripe_gateway import StripeGateway
from billing.stripe_push import push_usage
from billing.stripe_reconcile import reconcile
from billing.tables import USAGE_KINDS, UsageEvent
from core import tenants
from core.clock import FakeClock, SystemClock
from core.db import Database
from core.settings import Settings
from core.tables import Operation, OpStatus, TrainingRun
from scheduler.celery_app import make_celery
from scheduler.dispatch import wake_worker
from scheduler.ops import OpKind
from tests.builders import TenantKey, tenant_factory
from tests.cluster import SECRET, Cluster, cluster
from tests.embedded_app import datum
from tests.fakes import stripe_server
from tests.integration.stripe_helpers import hour_of
from tests.scenarios import ADAM, BATCH
from tests.services import throwaway_database

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

LLAMA, QWEN = "treadle/tiny-1m", "treadle/tiny-qwen-1m"
NEW_TRAINING_RATE = 12_345_678  # per 1M tokens, against the default 220,000
# The least delay the price book allows (TREADLE_PRICE_DELAY_SECONDS): the processes' price
# caches read the book every second, so they price by the new version from its first moment.
PRICE_DELAY = timedelta(seconds=5)
TOKENS = [(5 * i) % 300 + 20 for i in range(21)]
USAGE_OF_OP = {
    OpKind.FORWARD_BACKWARD: {"training"},
    OpKind.SAMPLE: {"sampling_prefill", "sampling_sample"},
    OpKind.SAVE_WEIGHTS: {"checkpoint"},
    OpKind.SAVE_WEIGHTS_FOR_SAMPLER: {"checkpoint"},
}


@dataclass
class Tenant:
    key: TenantKey
    customer: str
    api: str
    client: tinker.ServiceClient


@pytest.fixture
def running(
    tmp_path: Path, postgres_admin_url: str, redis_url: str
) -> Iterator[tuple[Cluster, Database, str]]:
    with (
        throwaway_database(postgres_admin_url) as db_url,
        cluster(
            tmp_path,
            db_url,
            redis_url,
            models=json.dumps([LLAMA, QWEN]),
            worker_lease_seconds="10",
            snapshot_every_steps="3",
        ) as group,
    ):
        for name in ("w1", "w2"):
            group.start_worker(name, LLAMA, QWEN)
        group.start_api("a1")
        group.start_api("a2")
        group.start_beat()
        database = Database(db_url)
        try:
            yield group, database, db_url
        finally:
            database.dispose()


def _sft(trainer: tinker.TrainingClient, steps: int) -> None:
    futures = []
    for _ in range(steps):
        futures.append(trainer.forward_backward(BATCH, "cross_entropy"))
        futures.append(trainer.optim_step(ADAM))
    for future in futures:
        future.result(timeout=300)


def _sample(sampler: tinker.SamplingClient) -> None:
    prompt = types.ModelInput.from_ints([15, 16, 17, 18])
    params = types.SamplingParams(max_tokens=4, seed=3)
    sampler.sample(prompt, num_samples=2, sampling_params=params).result(timeout=300)


def _holder(database: Database, run_id: str) -> str | None:
    with database.reader() as db:
        return db.scalar(select(TrainingRun.worker_id).where(TrainingRun.id == run_id))


class RawRun:
    """A training run driven over HTTP, as a client that retries by hand."""

    def __init__(self, api: str, key: str) -> None:
        self.http = httpx.Client(base_url=f"{api}/api/v1", headers={"X-API-Key": key}, timeout=60)
        session_id = self.http.post("/create_session", json={}).json()["session_id"]
        body = {
            "session_id": session_id,
            "model_seq_id": 0,
            "base_model": LLAMA,
            "lora_config": {"rank": 4, "seed": 5},
        }
        self.run_id = str(self.result(self.submit("create_model", body))["model_id"])

    def submit(self, route: str, body: dict[str, Any]) -> str:
        response = self.http.post(f"/{route}", json=body)
        assert response.status_code == 200, response.text
        return str(response.json()["request_id"])

    def result(self, request_id: str) -> dict[str, Any]:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            body = self.http.post("/retrieve_future", json={"request_id": request_id}).json()
            if body.get("type") != "try_again":
                assert "error" not in body, body
                return dict(body)
        raise AssertionError(f"request {request_id} did not finish")

    def forward_backward(self, seq_id: int) -> dict[str, Any]:
        return {
            "model_id": self.run_id,
            "seq_id": seq_id,
            "data": [datum(TOKENS)],
            "loss_fn": "cross_entropy",
        }

    def optim_step(self, seq_id: int) -> str:
        body = {"model_id": self.run_id, "seq_id": seq_id, "adam_params": {"learning_rate": 0.01}}
        return self.submit("optim_step", body)


def test_billing_holds_through_a_price_change_a_killed_worker_and_duplicates(
    running: tuple[Cluster, Database, str],
) -> None:
    started = time.monotonic()
    group, database, db_url = running
    clock = SystemClock()
    began = clock.now()
    settings = Settings(database_url=db_url, server_secret=SECRET)
    make_tenant = tenant_factory(database, settings)
    acme = _tenant(database, make_tenant("acme"), "cus_Acme", group.api_urls["a1"])
    globex = _tenant(database, make_tenant("globex"), "cus_Globex", group.api_urls["a2"])

    # Phase 1, at the default prices; LLAMA's training price changes as soon as the book allows
    # (seconds), and what runs meanwhile is priced on either side of the change.
    trainer_a = acme.client.create_lora_training_client(base_model=LLAMA, rank=4, seed=1).result()
    _sft(trainer_a, 2)
    with database.transaction() as db:
        default = rate_in_force(db, LLAMA, "training", clock.now())
        changed = set_price(
            db,
            clock,
            base_model=LLAMA,
            kind="training",
            unit_micros=NEW_TRAINING_RATE,
            delay=PRICE_DELAY,
        )
    assert default is not None and default.unit_micros != NEW_TRAINING_RATE
    trainer_b = globex.client.create_lora_training_client(base_model=QWEN, rank=4, seed=2).result()
    _sft(trainer_b, 2)

    # Acme's holder is killed with three steps in flight: they run, or run again, elsewhere.
    futures = []
    for _ in range(3):
        futures.append(trainer_a.forward_backward(BATCH, "cross_entropy"))
        futures.append(trainer_a.optim_step(ADAM))
    futures[0].result(timeout=300)
    victim = _holder(database, trainer_a.model_id)
    assert victim in group.workers
    group.kill(group.workers[victim])
    for future in futures:
        future.result(timeout=300)
    heir = _holder(database, trainer_a.model_id)
    assert heir is not None and heir != victim
    assert f"restored {trainer_a.model_id} from" in group.log(heir)  # and replayed its ops
    _sample(trainer_a.save_weights_and_get_sampling_client().result(timeout=300))
    trainer_a.save_state("before").result(timeout=300)

    # Globex retries a forward_backward whose answer it lost, and its worker is woken twice.
    raw = RawRun(globex.api, globex.key.key)
    first = raw.submit("forward_backward", raw.forward_backward(1))
    assert raw.submit("forward_backward", raw.forward_backward(1)) == first  # while queued
    celery = make_celery(Settings(redis_url=group.env["TREADLE_REDIS_URL"]))
    holder = _holder(database, raw.run_id)
    assert holder is not None
    wake_worker(celery, holder)
    wake_worker(celery, holder)
    raw.result(first)
    assert raw.submit("forward_backward", raw.forward_backward(1)) == first  # once done
    raw.result(raw.optim_step(2))
    _sample(trainer_b.save_weights_and_get_sampling_client().result(timeout=300))

    # Phase 2, once the new price is in force.
    waited = time.monotonic()
    while clock.now() <= changed.effective_from:
        time.sleep(0.5)
    waited = time.monotonic() - waited
    _sft(trainer_a, 2)
    _sample(trainer_a.save_weights_and_get_sampling_client().result(timeout=300))
    trainer_b.save_weights_for_sampler("after").result(timeout=300)
    _sft(trainer_b, 2)
    raw.result(raw.submit("forward_backward", raw.forward_backward(3)))
    trainer_b.save_state("after").result(timeout=300)
    for client in (acme.client, globex.client):
        client.close("success").result(timeout=60)
    raw.http.close()
    assert group.beat is not None
    group.kill(group.beat)  # nothing is metered behind the comparisons

    ours = (acme.key.tenant_id, globex.key.tenant_id)
    with database.reader() as db:
        events = list(db.scalars(select(UsageEvent).where(UsageEvent.tenant_id.in_(ours))))
        ops = db.execute(
            select(Operation.id, Operation.kind, Operation.status, Operation.attempts).where(
                Operation.tenant_id.in_(ours)
            )
        ).all()
        duplicates = db.scalar(
            select(func.count()).select_from(Operation).where(Operation.target_id == raw.run_id)
        )
        # Every event priced by the version in force at its time, to the micro-unit.
        used: set[int] = set()
        for event in events:
            at = event.hour if event.kind == "storage" else event.created_at
            rate = rate_in_force(db, event.base_model, event.kind, at)
            assert rate is not None and event.price_id == rate.id, event.id
            assert event.amount_micros == cost_micros(
                rate, event.quantity, event.cached_quantity
            ), event.id
            if (event.base_model, event.kind) == (LLAMA, "training"):
                used.add(rate.id)
        rollups = {
            tenant_id: rollup_totals(db, tenant_id, group_by=("kind",)) for tenant_id in ours
        }
        spend = {
            tenant_id: sum(
                period_spend(db, tenant_id, period)
                for period in {period_start(e.hour) for e in events if e.tenant_id == tenant_id}
            )
            for tenant_id in ours
        }
    assert used == {default.id, changed.id}  # the loop ran on both sides of the change

    # One ledger row per op and kind, and every done op that used the GPU has its rows.
    kinds_of: dict[str, list[str]] = defaultdict(list)
    for event in events:
        if event.operation_id is not None:
            kinds_of[event.operation_id].append(event.kind)
    assert all(len(kinds) == len(set(kinds)) for kinds in kinds_of.values())
    for op_id, kind, status, _ in ops:
        assert status == OpStatus.DONE, (op_id, kind, status)
        assert set(kinds_of.get(op_id, [])) == USAGE_OF_OP.get(OpKind(kind), set()), (op_id, kind)
    assert set(kinds_of) <= {op_id for op_id, *_ in ops}
    assert duplicates == 1 + 3  # create_model, two forward_backwards and an optim step

    # Stripe: every settled cell pushed once, from a clock past this hour's settle delay.
    later = FakeClock(clock.now() + timedelta(hours=2))
    with stripe_server.running(now=later.now) as fake:
        for kind in USAGE_KINDS:
            fake.add_meter(f"treadle_{kind}")
        gateway = StripeGateway(stripe_server.API_KEY, api_base=fake.url, sleep=lambda _: None)
        report = push_usage(database, gateway, later)
        assert report.pushed > 0 and report.refused == [] and report.too_old == []
        assert push_usage(database, gateway, later).pushed == 0
        reconciled = reconcile(database, gateway, later, since=hour_of(began))
        assert reconciled.balances and reconciled.differences == []
        identifiers = fake.identifiers()
        assert len(identifiers) == len(set(identifiers))
        stripe = {
            t.key.tenant_id: sum(fake.total(f"treadle_{kind}", t.customer) for kind in USAGE_KINDS)
            for t in (acme, globex)
        }

    window = (hour_of(began).isoformat(), (hour_of(clock.now()) + timedelta(hours=1)).isoformat())
    totals = {}
    for tenant in (acme, globex):
        tenant_id = tenant.key.tenant_id
        mine = [e for e in events if e.tenant_id == tenant_id]
        ledger = sum(e.amount_micros for e in mine)
        by_kind: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for e in mine:
            by_kind[e.kind][0] += e.quantity
            by_kind[e.kind][1] += e.amount_micros
        rolled = {r.group["kind"]: [r.quantity, r.amount_micros] for r in rollups[tenant_id]}
        assert rolled == by_kind
        with httpx.Client(
            base_url=f"{tenant.api}/api/v1", headers={"X-API-Key": tenant.key.key}, timeout=60
        ) as http:
            report_body = http.get("/usage").json()
        lines: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        for e in mine:
            lines[(e.base_model, e.kind)][0] += e.quantity
            lines[(e.base_model, e.kind)][1] += e.amount_micros
        assert {
            (line["base_model"], line["kind"]): [line["quantity"], line["amount_micros"]]
            for line in report_body["lines"]
        } == lines
        admin = tinker.AdminClient(base_url=tenant.api, api_key=tenant.key.key)
        buckets = admin.get_billing_usage(*window).result().data
        sdk_micros = sum(round((b.estimated_cost_usd or 0) * 1_000_000) for b in buckets)
        totals[tenant.customer] = ledger
        assert ledger > 0
        assert report_body["total_micros"] == ledger
        assert sum(amount for _, amount in rolled.values()) == ledger
        assert spend[tenant_id] == ledger
        assert sdk_micros == ledger
        assert stripe[tenant_id] == ledger
    replayed = sum(1 for *_, attempts in ops if attempts > 1)
    print(
        f"\nbilled {totals} micro-units over {len(events)} events and {len(ops)} ops "
        f"({replayed} run again after the kill); prices {default.id} -> {changed.id} at "
        f"{changed.effective_from:%H:%M:%S} (waited {waited:.0f} s for it); "
        f"{report.pushed} meter events; {time.monotonic() - started:.0f} s"
    )


def _tenant(database: Database, key: TenantKey, customer: str, api: str) -> Tenant:
    with database.transaction() as db:
        row = tenants.find_tenant(db, key.tenant_id)
        tenants.link_stripe_customer(db, SystemClock(), row, customer, actor="operator")
    return Tenant(key, customer, api, tinker.ServiceClient(base_url=api, api_key=key.key))
