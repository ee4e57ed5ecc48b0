"""`treadle-server admin tenants` sets, resets and lists a tenant's resource limits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from core.db import Database
from core.tables import Tenant

pytestmark = pytest.mark.e2e

CLI = str(Path(sys.executable).with_name("treadle-server"))


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    """One database: each command's subprocesses cost seconds, and what the commands write is
    tested on both databases by the integration tests."""
    return sqlite_url


def _cli(tmp_path: Path, database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TREADLE_")}
    env.update(
        TREADLE_DATA_DIR=str(tmp_path / "data"), TREADLE_DATABASE_URL=database_url, COLUMNS="300"
    )
    return subprocess.run(
        [CLI, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def _listed(output: str) -> dict[str, dict[str, str]]:
    """`tenants list` as {tenant name: {column: cell}}."""
    lines = output.splitlines()
    header = next(line for line in lines if "┃" in line)
    columns = [cell.strip() for cell in header.split("┃")[1:-1]]
    rows = {}
    for line in lines:
        if line.startswith("│"):
            cells = dict(zip(columns, (c.strip() for c in line.split("│")[1:-1]), strict=True))
            rows[cells["name"]] = cells
    return rows


def test_tenant_resource_limits_are_set_reset_and_listed(tmp_path: Path, database_url: str) -> None:
    def ok(*args: str) -> str:
        done = _cli(tmp_path, database_url, *args)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    ok("migrate")
    ok("admin", "tenants", "create", "acme", "--max-training-runs", "8")
    ok("admin", "tenants", "create", "globex", "--max-lora-parameters", "1,000,000")
    ok(
        "admin",
        "tenants",
        "update",
        "acme",
        "--max-queued-ops",
        "50",
        "--max-sampling-requests",
        "0",
        "--max-training-runs",
        "default",
    )

    listed = _listed(ok("admin", "tenants", "list"))
    limits = ("max runs", "max LoRA params", "max queued ops", "max sampling")
    assert [listed["acme"][c] for c in limits] == [
        "64 (default)",
        "2,000,000,000 (default)",
        "50",
        "0",
    ]
    assert [listed["globex"][c] for c in limits] == [
        "64 (default)",
        "1,000,000",
        "10,000 (default)",
        "1,024 (default)",
    ]
    database = Database(database_url)
    with database.reader() as db:
        acme = db.scalar(select(Tenant).where(Tenant.name == "acme"))
        assert acme is not None
        assert (acme.max_training_runs, acme.max_queued_ops, acme.max_sampling_requests) == (
            None,
            50,
            0,
        )
    database.dispose()

    for option, value, message in (
        ("--max-queued-ops", "lots", "--max-queued-ops takes a whole number or 'default'"),
        ("--max-training-runs", "-1", "max_training_runs -1 is outside 0..2147483647"),
    ):
        refused = _cli(tmp_path, database_url, "admin", "tenants", "update", "acme", option, value)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert message in " ".join(refused.stderr.split())
    assert _listed(ok("admin", "tenants", "list"))["acme"] == listed["acme"]
