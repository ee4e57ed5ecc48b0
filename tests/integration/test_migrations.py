"""Alembic revisions go up and down on SQLite and PostgreSQL; servers refuse stale schemas."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import MetaData, inspect, select, text

import billing.tables  # noqa: F401  (registers billing tables)
from api import dbschema
from api.app import create_app
from billing.rollups import RolledEvent, add_to_rollups, recompute_rollups
from billing.tables import DailyUsage, UsageEvent, UsageRollup
from core.db import Database
from core.errors import DatabaseNotMigrated
from core.tables import Base
from tests.builders import make_settings

pytestmark = pytest.mark.integration

DESIGN_TABLES = {
    "tenants",
    "api_keys",
    "sessions",
    "training_runs",
    "sampling_sessions",
    "operations",
    "usage_events",
    "usage_rollups",
    "prices",
    "model_packages",
    "model_versions",
    "model_aliases",
    "workers",
    "audit_log",
}


def test_upgrade_to_head_and_back_to_empty(database_url: str) -> None:
    database = Database(database_url)
    dbschema.upgrade(database)
    tables = set(inspect(database.engine).get_table_names())
    assert tables >= DESIGN_TABLES
    assert dbschema.current_revision(database) == dbschema.head_revision(database)
    dbschema.require_head(database)

    dbschema.downgrade(database, "base")
    assert set(inspect(database.engine).get_table_names()) <= {"alembic_version"}
    assert dbschema.current_revision(database) is None

    dbschema.upgrade(database)  # and up again: downgrade left nothing behind
    assert set(inspect(database.engine).get_table_names()) >= DESIGN_TABLES


def test_migrations_match_the_models(database_url: str) -> None:
    """Autogenerate finds nothing to do: the revisions create exactly what the models declare."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    database = Database(database_url)
    dbschema.upgrade(database)
    with database.engine.connect() as conn:
        diff = compare_metadata(
            MigrationContext.configure(conn, opts={"compare_type": False}), Base.metadata
        )
    assert diff == []


def test_server_refuses_an_unmigrated_database(tmp_path: Path, database_url: str) -> None:
    settings = make_settings(tmp_path, database_url)
    with pytest.raises(DatabaseNotMigrated, match="run `treadle-server migrate`"):
        create_app(settings)


def test_embedded_default_database_is_migrated_on_start(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, "sqlite:///unused").model_copy(update={"database_url": None})
    app = create_app(settings)
    database = app.state.treadle.database
    assert dbschema.current_revision(database) == dbschema.head_revision(database)
    assert (tmp_path / "data" / "treadle.db").exists()


def test_billing_revision_gives_recorded_usage_its_utc_hour(database_url: str) -> None:
    """0005 keeps the usage recorded before it, each event in the UTC hour it was recorded in
    (on PostgreSQL even for a session whose time zone is half an hour off UTC), unpriced."""
    database = Database(database_url)
    if database.engine.dialect.name == "postgresql":
        with database.engine.begin() as conn:
            name = conn.execute(text("SELECT current_database()")).scalar_one()
            conn.execute(text(f"ALTER DATABASE \"{name}\" SET timezone TO 'Asia/Kolkata'"))
        database.engine.dispose()
    dbschema.upgrade(database, "0004")
    tables = MetaData()
    tables.reflect(database.engine, only=["tenants", "sessions", "operations", "usage_events"])
    t = datetime(2026, 3, 31, 23, 59, 59, 999_999, tzinfo=UTC)
    recorded = [t, t + timedelta(microseconds=1), t - timedelta(minutes=30), t + timedelta(hours=5)]
    with database.engine.begin() as conn:
        conn.execute(tables.tables["tenants"].insert(), [_tenant_row(t)])
        conn.execute(
            tables.tables["sessions"].insert(),
            [
                dict(
                    id="s1",
                    tenant_id="t1",
                    status="active",
                    tags=[],
                    created_at=t,
                    last_heartbeat_at=t,
                )
            ],
        )
        conn.execute(
            tables.tables["operations"].insert(),
            [
                dict(
                    id=f"op{i}",
                    tenant_id="t1",
                    session_id="s1",
                    target_id="r1",
                    kind="forward_backward",
                    status="done",
                    payload=b"",
                    payload_codec="json",
                    attempts=1,
                    created_at=at,
                )
                for i, at in enumerate(recorded)
            ],
        )
        conn.execute(
            tables.tables["usage_events"].insert(),
            [
                dict(
                    tenant_id="t1",
                    session_id="s1",
                    operation_id=f"op{i}",
                    kind="training",
                    base_model="m",
                    quantity=10 + i,
                    cached_quantity=0,
                    created_at=at,
                )
                for i, at in enumerate(recorded)
            ],
        )

    dbschema.upgrade(database)
    with database.reader() as db:
        events = db.scalars(select(UsageEvent).order_by(UsageEvent.quantity)).all()
        assert [(e.created_at, e.hour, e.price_id, e.amount_micros) for e in events] == [
            (at, at.replace(minute=0, second=0, microsecond=0), None, 0) for at in recorded
        ]
        assert [e.hour.isoformat() for e in events] == [
            "2026-03-31T23:00:00+00:00",
            "2026-04-01T00:00:00+00:00",
            "2026-03-31T23:00:00+00:00",
            "2026-04-01T04:00:00+00:00",
        ]
        # The rollups rebuilt from them (unpriced: price 0) hold every event.
        recompute_rollups(db)
        assert sum(r.events for r in db.scalars(select(UsageRollup))) == 4


def test_daily_revision_sums_the_hourly_rollups_per_utc_day(database_url: str) -> None:
    """0009 fills the daily rollups from the hourly ones recorded before it: summed over
    sessions and prices per UTC day (on PostgreSQL even for a session whose time zone is half
    an hour off UTC, where 19:00 UTC is already the next day)."""
    database = Database(database_url)
    if database.engine.dialect.name == "postgresql":
        with database.engine.begin() as conn:
            name = conn.execute(text("SELECT current_database()")).scalar_one()
            conn.execute(text(f"ALTER DATABASE \"{name}\" SET timezone TO 'Asia/Kolkata'"))
        database.engine.dispose()
    dbschema.upgrade(database, "0008")
    tables = MetaData()
    tables.reflect(database.engine, only=["tenants", "usage_rollups"])
    day = datetime(2026, 3, 31, tzinfo=UTC)
    # (hour, API key, session, price, events, quantity, cached, amount)
    cells = [
        (day + timedelta(hours=18), "k1", "s1", 1, 2, 100, 10, 1000),
        (day + timedelta(hours=19), "k1", "s2", 1, 1, 50, 0, 500),
        (day + timedelta(hours=23), "k1", "s1", 2, 3, 30, 3, 300),
        (day + timedelta(hours=23), "", "", 0, 1, 7, 0, 0),
        (day + timedelta(hours=24), "k1", "s1", 2, 1, 5, 0, 50),
    ]
    with database.engine.begin() as conn:
        conn.execute(tables.tables["tenants"].insert(), [_tenant_row(day)])
        conn.execute(
            tables.tables["usage_rollups"].insert(),
            [
                dict(
                    tenant_id="t1",
                    hour=hour,
                    api_key_id=key,
                    session_id=session,
                    base_model="m",
                    kind="training",
                    price_id=price,
                    events=events,
                    quantity=quantity,
                    cached_quantity=cached,
                    amount_micros=amount,
                )
                for hour, key, session, price, events, quantity, cached, amount in cells
            ],
        )

    dbschema.upgrade(database, "0009")
    # Usage recorded afterwards adds to the filled rows: their days are stored alike.
    later = RolledEvent("t1", day + timedelta(hours=20), "k1", None, "m", "training", 1, 1, 0, 1)
    with database.transaction() as db:
        add_to_rollups(db, [later])
    with database.reader() as db:
        days = {
            (d.day, d.tenant_id, d.api_key_id, d.base_model, d.kind): (
                d.events,
                d.quantity,
                d.cached_quantity,
                d.amount_micros,
            )
            for d in db.scalars(select(DailyUsage))
        }
    assert days == {
        (day, "t1", "k1", "m", "training"): (7, 181, 13, 1801),
        (day, "t1", "", "m", "training"): (1, 7, 0, 0),
        (day + timedelta(days=1), "t1", "k1", "m", "training"): (1, 5, 0, 50),
    }


def _tenant_row(created_at: datetime) -> dict[str, object]:
    """Tenant t1 as the revisions under test stored it."""
    return dict(
        id="t1",
        name="acme",
        max_concurrent_sessions=1,
        max_lora_rank=8,
        disabled=False,
        created_at=created_at,
    )


def test_group_size_revision_makes_every_registered_worker_one_device(database_url: str) -> None:
    """0011 adds `workers.group_size`, 1 for the workers registered before it; going back drops
    it and keeps the workers."""
    database = Database(database_url)
    dbschema.upgrade(database, "0010")
    tables = MetaData()
    tables.reflect(database.engine, only=["workers"])
    now = datetime(2026, 3, 31, tzinfo=UTC)
    with database.engine.begin() as conn:
        conn.execute(
            tables.tables["workers"].insert(),
            [
                dict(
                    id="w1",
                    hostname="h",
                    device="cuda:0",
                    models=[{"name": "m"}],
                    status="live",
                    held_runs=2,
                    adapter_bytes=0,
                    lease_expires_at=now,
                    registered_at=now,
                )
            ],
        )

    dbschema.upgrade(database, "0011")
    with database.engine.connect() as conn:
        assert conn.execute(text("SELECT id, group_size FROM workers")).all() == [("w1", 1)]

    dbschema.downgrade(database, "0010")
    columns = {c["name"] for c in inspect(database.engine).get_columns("workers")}
    assert "group_size" not in columns
    with database.engine.connect() as conn:
        assert conn.execute(text("SELECT id, held_runs FROM workers")).all() == [("w1", 2)]
