"""`treadle-server admin tenants set-limit` sets and removes a tenant's monthly and per-session
spend limits, exactly in micro-units, and writes each change to the audit log."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from core.db import Database
from core.tables import AuditLog, Tenant

pytestmark = pytest.mark.e2e

CLI = str(Path(sys.executable).with_name("treadle-server"))


def _cli(tmp_path: Path, database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TREADLE_")}
    env.update(
        TREADLE_DATA_DIR=str(tmp_path / "data"), TREADLE_DATABASE_URL=database_url, COLUMNS="300"
    )
    return subprocess.run(
        [CLI, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_spend_limits_are_set_removed_and_audited(tmp_path: Path, sqlite_url: str) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return _cli(tmp_path, sqlite_url, *args)

    assert run("migrate").returncode == 0
    assert run("admin", "tenants", "create", "acme").returncode == 0
    done = run(
        "admin", "tenants", "set-limit", "acme", "--monthly", "12.5", "--per-session", "0.000001"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "monthly limit 12.50" in done.stdout

    database = Database(sqlite_url)

    def limits() -> tuple[int | None, int | None]:
        with database.reader() as db:
            tenant = db.scalars(select(Tenant).where(Tenant.name == "acme")).one()
            return tenant.spend_limit_micros, tenant.session_spend_limit_micros

    assert limits() == (12_500_000, 1)
    assert run("admin", "tenants", "set-limit", "acme", "--no-monthly").returncode == 0
    assert limits() == (None, 1)  # the per-session limit is kept

    with database.reader() as db:
        changes = [
            entry.detail
            for entry in db.scalars(
                select(AuditLog)
                .where(AuditLog.action == "tenant.limit_changed")
                .order_by(AuditLog.id)
            )
        ]
    assert changes == [
        {
            "spend_limit_micros": {"from": None, "to": 12_500_000},
            "session_spend_limit_micros": {"from": None, "to": 1},
        },
        {"spend_limit_micros": {"from": 12_500_000, "to": None}},
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--monthly", "5", "--no-monthly"), "not both"),
        ((), "pass --monthly, --no-monthly, --per-session or --no-per-session"),
        (("--monthly", "0.0000001"), "finer than a micro-dollar"),
        (("--per-session", "-1"), "--per-session is negative"),
    ],
)
def test_what_cannot_be_a_limit_is_refused(
    tmp_path: Path, sqlite_url: str, args: tuple[str, ...], message: str
) -> None:
    assert _cli(tmp_path, sqlite_url, "migrate").returncode == 0
    assert _cli(tmp_path, sqlite_url, "admin", "tenants", "create", "acme").returncode == 0
    done = _cli(tmp_path, sqlite_url, "admin", "tenants", "set-limit", "acme", *args)
    assert done.returncode != 0
    assert message in done.stdout + done.stderr
