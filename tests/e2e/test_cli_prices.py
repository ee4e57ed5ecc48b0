"""`treadle-server admin prices`: the defaults listed, a new version scheduled (never sooner
than allowed), every version in the history, money given in dollars and kept in micro-units."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from billing.tables import Price
from core.db import Database

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


def _table(output: str) -> list[dict[str, str]]:
    lines = output.splitlines()
    header = next(line for line in lines if "┃" in line)
    columns = [cell.strip() for cell in header.split("┃")[1:-1]]
    return [
        dict(zip(columns, (c.strip() for c in line.split("│")[1:-1]), strict=True))
        for line in lines
        if line.startswith("│")
    ]


def test_prices_are_listed_set_for_later_and_kept_as_versions(
    tmp_path: Path, database_url: str
) -> None:
    def ok(*args: str) -> str:
        done = _cli(tmp_path, database_url, *args)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def refused(*args: str) -> str:
        done = _cli(tmp_path, database_url, *args)
        assert done.returncode == 2, done.stdout + done.stderr
        return " ".join(done.stderr.split())

    ok("migrate")
    defaults = {(r["model"], r["kind"]): r for r in _table(ok("admin", "prices", "list"))}
    assert {k: (r["price ($)"], r["cached ($)"], r["unit"]) for k, r in defaults.items()} == {
        ("*", "training"): ("0.22", "", "per 1M tokens"),
        ("*", "sampling_prefill"): ("0.07", "0.014", "per 1M tokens"),
        ("*", "sampling_sample"): ("0.22", "", "per 1M tokens"),
        ("*", "checkpoint"): ("0.00", "", "per checkpoint"),
        ("*", "storage"): ("0.10", "", "per GB-month"),
    }

    set_now = ok(
        "admin",
        "prices",
        "set",
        "treadle/tiny-10m",
        "sampling_prefill",
        "$1.25",
        "--cached",
        "0.000001",
    )
    later = ok("admin", "prices", "set", "*", "training", "0.3", "--effective", "2099-01-01T00:00Z")
    assert "treadle/tiny-10m sampling_prefill: $1.25 per 1M tokens from" in set_now
    assert "* training: $0.30 per 1M tokens from 2099-01-01T00:00:00+00:00" in later

    past = refused(
        "admin", "prices", "set", "*", "training", "0.5", "--effective", "2020-01-01T00:00Z"
    )
    assert "is too soon: a price version takes effect no sooner than 60 s after it is set" in past
    assert "so that every server process has read it before it applies" in past
    assert "finer than a micro-dollar" in refused(
        "admin", "prices", "set", "*", "training", "0.0000001"
    )
    assert "give dollars as a number" in refused("admin", "prices", "set", "*", "training", "free")
    assert "no time zone" in refused(
        "admin", "prices", "set", "*", "training", "1", "--effective", "2099-01-01T00:00"
    )
    assert "unknown usage kind 'gpu'" in refused("admin", "prices", "set", "*", "gpu", "1")

    # Neither new version is in force yet: the list is still the defaults, and says so.
    listed = ok("admin", "prices", "list")
    assert {(r["model"], r["kind"]) for r in _table(listed)} == set(defaults)
    assert "2 version(s) take effect later" in listed
    history = _table(ok("admin", "prices", "history"))
    assert [(r["model"], r["kind"], r["state"]) for r in history[:2]] == [
        ("*", "training", "scheduled"),
        ("treadle/tiny-10m", "sampling_prefill", "scheduled"),
    ]
    assert sorted(r["state"] for r in history[2:]) == ["in force"] * 5
    only = _table(ok("admin", "prices", "history", "--model", "treadle/tiny-10m"))
    assert [(r["price ($)"], r["cached ($)"]) for r in only] == [("1.25", "0.000001")]

    with Database(database_url).reader() as db:
        mine = db.scalars(select(Price).where(Price.base_model == "treadle/tiny-10m")).one()
    assert (mine.unit_micros, mine.cached_unit_micros, mine.created_by) == (
        1_250_000,
        1,
        "operator",
    )
    # Set now: in force from the first whole minute at least a minute after it was set.
    assert mine.effective_from.second == 0
    assert timedelta(seconds=60) <= mine.effective_from - mine.created_at < timedelta(seconds=120)
    assert mine.created_at <= datetime.now(UTC)
