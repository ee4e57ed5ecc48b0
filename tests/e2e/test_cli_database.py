"""`treadle-server admin` never writes to the wrong place: each write names its database on
stderr, distributed settings without `TREADLE_DATABASE_URL` are refused rather than served by
the embedded SQLite file, and a key for a shared database is hashed with the API's secret or
not made at all."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from api.cli import app
from core.apikeys import is_key_usable
from core.db import Database
from core.settings import Settings

pytestmark = pytest.mark.e2e

KEY_RE = re.compile(r"tml-[0-9a-f]{12}-[A-Za-z0-9_-]{32,}")
SECRET = "an-api-secret-0123456789abcdef"


def _run(tmp_path: Path, *args: str, **settings: str) -> Result:
    """The command run in this process (the refusals cost no start-up), with only `settings`
    and a data folder of its own for environment."""
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("TREADLE_")}
    env.update(TREADLE_DATA_DIR=str(tmp_path / "data"), COLUMNS="200", **settings)
    return CliRunner().invoke(app, list(args), env=env)


def test_each_write_names_its_database_on_stderr(tmp_path: Path) -> None:
    embedded = f"database: SQLite file {tmp_path / 'data' / 'treadle.db'} (embedded)"
    for args in (
        ("migrate",),
        ("admin", "tenants", "create", "acme"),
        ("admin", "tenants", "update", "acme", "--max-sessions", "2"),
    ):
        done = _run(tmp_path, *args)
        assert done.exit_code == 0, done.stderr
        assert done.stderr.splitlines()[0] == embedded, done.stderr
        assert "database:" not in done.stdout
    key = _run(tmp_path, "admin", "keys", "create", "acme")
    assert key.exit_code == 0 and embedded in key.stderr, key.stderr
    assert KEY_RE.fullmatch(key.stdout.strip())  # stdout stays the key alone, for scripts
    listing = _run(tmp_path, "admin", "tenants", "list")
    assert listing.exit_code == 0 and "database:" not in listing.stderr  # reads say nothing

    other = tmp_path / "other.db"
    named = _run(tmp_path, "migrate", TREADLE_DATABASE_URL=f"sqlite:///{other}")
    assert named.exit_code == 0, named.stderr
    assert named.stderr.splitlines()[0] == f"database: SQLite file {other}"


@pytest.mark.parametrize(
    "present",
    [
        {"TREADLE_REDIS_URL": "redis://127.0.0.1:1/0"},
        {"TREADLE_SERVER_SECRET": SECRET},
    ],
    ids=["redis", "secret"],
)
def test_distributed_settings_without_a_database_url_are_refused(
    tmp_path: Path, present: dict[str, str]
) -> None:
    (variable,) = present
    for args in (
        ("migrate",),
        ("admin", "tenants", "create", "acme"),
        ("admin", "keys", "create", "acme"),
        ("admin", "prices", "list"),
        ("admin", "workers"),
    ):
        done = _run(tmp_path, *args, **present)
        assert done.exit_code == 2, (args, done.output)
        message = " ".join(done.stderr.split())
        assert f"{variable} is set but TREADLE_DATABASE_URL is not" in message, message
    assert not (tmp_path / "data" / "treadle.db").exists()


def test_a_key_for_a_shared_database_needs_the_api_secret(
    tmp_path: Path, postgres_url: str
) -> None:
    shared = {"TREADLE_DATABASE_URL": postgres_url}
    unreachable = "postgresql+psycopg://treadle:hunter2@127.0.0.1:1/treadle"
    refused = _run(tmp_path, "admin", "keys", "create", "acme", TREADLE_DATABASE_URL=unreachable)
    assert refused.exit_code == 2
    message = " ".join(refused.stderr.split())
    assert "TREADLE_SERVER_SECRET is not set" in message, message
    assert "treadle:***@127.0.0.1:1/treadle" in message and "hunter2" not in message
    assert not (tmp_path / "data" / "server-secret").exists()  # no embedded secret was made

    assert _run(tmp_path, "migrate", **shared).exit_code == 0
    assert _run(tmp_path, "admin", "tenants", "create", "acme", **shared).exit_code == 0
    made = _run(tmp_path, "admin", "keys", "create", "acme", TREADLE_SERVER_SECRET=SECRET, **shared)
    assert made.exit_code == 0, made.stderr
    key = made.stdout.strip()
    database = Database(postgres_url)
    try:
        with database.reader() as db:
            assert is_key_usable(db, SECRET.encode(), key)  # what the API replicas check
            embedded = Settings(data_dir=tmp_path / "data", database_url=None).secret_bytes()
            assert not is_key_usable(db, embedded, key)
    finally:
        database.dispose()
