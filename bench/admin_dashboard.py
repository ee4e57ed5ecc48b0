"""The admin dashboard's pages and JSON routes on a large ledger, beside the floor measured in
the same run.

Seeds a fresh database (SQLite unless --database-url names a PostgreSQL one) with `--tenants`
tenants, an API key each, a price per usage kind and `--events` priced usage events spread
over the last `--days` days, bulk-inserted straight into the ledger; the hourly and daily
rollups and the spend counters are then rebuilt from it by billing's own repair jobs
(`recompute_rollups`, `recompute_spend`), so they hold what recording each event would have
written. Every tenant is linked to a Stripe customer, and `stripe_meter_pushes` holds one
accepted part per priced cell of the rollups up to three hours before the last settled hour,
as pushes that then stopped would have left it (the billing page has a lag to find). The
writes are then flushed to disk, and PostgreSQL's tables vacuumed and analyzed as autovacuum
soon would, so the timings see the steady state rather than the minute after a load. A real
server (uvicorn, in a thread), once its engine has started, then answers `--requests` requests per route, one at a time on a
kept-alive connection: every dashboard page and JSON route, and `GET /api/v1/healthz` as the
floor. Prints JSON: seeding sizes and times, and p50/p95 per route in milliseconds.

    python bench/admin_dashboard.py [--events 1000000] [--tenants 100] [--requests 30]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from sqlalchemy import func, insert, select, text, update

from api.app import create_app
from api.dbschema import upgrade
from billing.pricebook import set_price
from billing.prices import Rate, cost_micros
from billing.rollups import recompute_rollups
from billing.spend import recompute_spend
from billing.stripe_parts import Cell, push_identifier
from billing.stripe_push import settled_before
from billing.tables import DailyUsage, StripeMeterPush, UsageEvent, UsageRollup
from core import apikeys, tenants
from core.clock import FakeClock
from core.db import Database
from core.settings import Settings
from core.tables import Tenant

MODELS = ("treadle/tiny-1m", "treadle/tiny-10m", "Qwen/Qwen3-8B")
# Kind, relative frequency, typical quantity.
KINDS = (
    ("training", 5, 4000),
    ("sampling_prefill", 3, 2000),
    ("sampling_sample", 3, 500),
    ("checkpoint", 1, 1),
)
PRICES = {"training": 400_000, "sampling_prefill": 100_000, "sampling_sample": 300_000}
BATCH = 50_000


def seed(
    database: Database, secret: bytes, now: datetime, n_tenants: int, n_events: int, days: int
) -> dict[str, Any]:
    """Tenants, their keys, prices and the ledger; returns the admin key and what was made."""
    clock = FakeClock(now - timedelta(days=days + 1))
    with database.transaction() as db:
        rates: dict[str, Rate] = {
            kind: set_price(db, clock, base_model="*", kind=kind, unit_micros=micros)
            for kind, micros in PRICES.items()
        } | {
            "checkpoint": set_price(
                db, clock, base_model="*", kind="checkpoint", unit_micros=20_000
            )
        }
        admin_tenant = tenants.create_tenant(
            db, clock, "operators", max_concurrent_sessions=1, max_lora_rank=8
        )
        _, admin_key = apikeys.issue_api_key(
            db, clock, secret, admin_tenant, name="bench", scope="admin"
        )
        owners = []
        for i in range(n_tenants):
            tenant = tenants.create_tenant(
                db, clock, f"tenant-{i:03d}", max_concurrent_sessions=8, max_lora_rank=64
            )
            key, _ = apikeys.issue_api_key(db, clock, secret, tenant, name="ci", scope="tenant")
            owners.append((tenant.id, key.id))
    rng = random.Random(0)
    weights = [w for _, w, _ in KINDS]
    first_hour = (now - timedelta(days=days)).replace(minute=0, second=0, microsecond=0)
    hours = days * 24
    started = time.perf_counter()
    with database.transaction() as db:
        for start in range(0, n_events, BATCH):
            rows = []
            for _ in range(min(BATCH, n_events - start)):
                tenant_id, key_id = owners[min(int(rng.paretovariate(1.2)) - 1, n_tenants - 1)]
                kind, _, typical = rng.choices(KINDS, weights)[0]
                quantity = max(1, int(rng.expovariate(1 / typical)))
                rate = rates[kind]
                hour = first_hour + timedelta(hours=rng.randrange(hours))
                rows.append(
                    {
                        "tenant_id": tenant_id,
                        "api_key_id": key_id,
                        "kind": kind,
                        "base_model": rng.choice(MODELS),
                        "quantity": quantity,
                        "cached_quantity": 0,
                        "price_id": rate.id,
                        "amount_micros": cost_micros(rate, quantity),
                        "hour": hour,
                        "created_at": hour + timedelta(seconds=rng.randrange(3600)),
                    }
                )
            db.execute(insert(UsageEvent), rows)
    inserted = time.perf_counter()
    with database.transaction() as db:
        recompute_rollups(db)
        recompute_spend(db)
        rollups = db.scalar(select(func.count()).select_from(UsageRollup))
        daily_rollups = db.scalar(select(func.count()).select_from(DailyUsage))
    stripe_parts = seed_stripe(database, now, unpushed_hours=3)
    rolled = time.perf_counter()
    # Timed is the steady state, not the minute after a load: the load's writes reach the
    # disk (checkpointed, synced) before the timings rather than amid them, and on PostgreSQL
    # the tables get what autovacuum soon gives them (the planner's statistics, and the
    # visibility map that lets an index-only scan skip the table).
    with database.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        if database.engine.dialect.name == "postgresql":
            conn.execute(text("VACUUM ANALYZE"))
            conn.execute(text("CHECKPOINT"))
        else:
            conn.execute(text("PRAGMA wal_checkpoint(TRUNCATE)"))
    os.sync()
    return {
        "admin_key": admin_key,
        "events": n_events,
        "tenants": n_tenants,
        "rollup_rows": rollups,
        "daily_rollup_rows": daily_rollups,
        "stripe_parts": stripe_parts,
        "insert_seconds": round(inserted - started, 1),
        "rollup_seconds": round(rolled - inserted, 1),
        "settle_seconds": round(time.perf_counter() - rolled, 1),
    }


def seed_stripe(database: Database, now: datetime, unpushed_hours: int) -> int:
    """Link every tenant to a Stripe customer, and record one accepted part per priced cell of
    the rollups before the last `unpushed_hours` settled hours; returns the parts recorded."""
    pushed_before = settled_before(now, 600) - timedelta(hours=unpushed_hours)
    cells = (UsageRollup.tenant_id, UsageRollup.kind, UsageRollup.hour, UsageRollup.price_id)
    with database.transaction() as db:
        for tenant_id in db.scalars(select(Tenant.id)).all():
            db.execute(
                update(Tenant)
                .where(Tenant.id == tenant_id)
                .values(stripe_customer_id=f"cus_{tenant_id}")
            )
        rows = [
            {
                "identifier": push_identifier(Cell(tenant_id, kind, hour, price_id), 0),
                "tenant_id": tenant_id,
                "stripe_customer_id": f"cus_{tenant_id}",
                "kind": kind,
                "hour": hour,
                "price_id": price_id,
                "part": 0,
                "value_micros": int(total),
                "intended_at": hour + timedelta(minutes=70),
                "accepted_at": hour + timedelta(minutes=70),
            }
            for tenant_id, kind, hour, price_id, total in db.execute(
                select(*cells, func.sum(UsageRollup.amount_micros))
                .where(UsageRollup.price_id != 0, UsageRollup.hour < pushed_before)
                .group_by(*cells)
            )
        ]
        for start in range(0, len(rows), BATCH):
            db.execute(insert(StripeMeterPush), rows[start : start + BATCH])
    return len(rows)


@contextlib.contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    # Timed is the server at work, not its start-up: the embedded engine imports torch and
    # sizes each model's adapters in a thread of its own for the first seconds.
    if not app.state.treadle.dispatcher.wait_ready(300):
        raise RuntimeError("the server's engine did not start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def timed(client: httpx.Client, path: str, n: int) -> dict[str, float]:
    client.get(path).raise_for_status()  # warm: templates compiled, statements cached
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        client.get(path).raise_for_status()
        samples.append((time.perf_counter() - started) * 1000)
    return {
        "p50": round(statistics.median(samples), 2),
        "p95": round(statistics.quantiles(samples, n=20)[-1], 2),
    }


def routes(now: datetime, days: int) -> list[str]:
    week = f"start={(now - timedelta(days=6)).date()}&end={(now + timedelta(days=1)).date()}"
    span = f"start={(now - timedelta(days=days)).date()}&end={(now + timedelta(days=1)).date()}"
    # A week cut mid-day at both ends: its first and last days are read hour by hour.
    noon = (now - timedelta(days=7)).replace(hour=12, minute=0, second=0, microsecond=0)
    cut = f"start={noon:%Y-%m-%dT%H:%M}&end={noon + timedelta(days=7):%Y-%m-%dT%H:%M}"
    return [
        "/api/v1/healthz",
        "/admin/usage",
        f"/admin/api/usage?{week}&bucket=day&group=tenant",
        f"/admin/api/usage?{week}&bucket=hour&group=tenant",
        f"/admin/api/usage?{week}&bucket=day&group=key",
        f"/admin/api/usage?{week}&bucket=day&group=model",
        f"/admin/api/usage?{cut}&bucket=day&group=tenant",
        f"/admin/api/usage?{span}&bucket=day&group=tenant",
        f"/admin/api/usage.csv?{span}&bucket=day&group=kind",
        "/admin/api/tenants",
        "/admin/api/live",
        "/admin/api/fleet",
        "/admin/tenants",
        "/admin/live",
        "/admin/fleet",
        "/admin/api/billing",
        "/admin/billing",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database-url", help="an empty database (default: a new SQLite file)")
    parser.add_argument("--tenants", type=int, default=100)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--days", type=int, default=30, help="the span the events fall in")
    parser.add_argument("--requests", type=int, default=30, help="timed requests per route")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="treadle-admin-bench-"))
    url = args.database_url or f"sqlite:///{folder / 'treadle.db'}"
    database = Database(url)
    upgrade(database)
    settings = Settings(
        data_dir=folder / "data",
        database_url=url,
        server_secret="bench-secret-0123456789abcdef",  # type: ignore[arg-type]
    )
    now = datetime.now(UTC)
    seeded = seed(database, settings.secret_bytes(), now, args.tenants, args.events, args.days)
    admin_key = seeded.pop("admin_key")
    results: dict[str, Any] = {"database": url.split(":")[0], "seeded": seeded, "ms": {}}
    with (
        serving(create_app(settings)) as base_url,
        httpx.Client(base_url=base_url, timeout=120, follow_redirects=True) as client,
    ):
        client.post("/admin/login", data={"key": admin_key}).raise_for_status()
        for path in routes(now, args.days):
            results["ms"][path] = timed(client, path, args.requests)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
