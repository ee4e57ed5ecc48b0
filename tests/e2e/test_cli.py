"""The `treadle-server` command as an operator runs it: serve, migrate, admin; no key leaks."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.services import free_port

pytestmark = pytest.mark.e2e

CLI = str(Path(sys.executable).with_name("treadle-server"))
KEY_RE = re.compile(r"tml-[0-9a-f]{12}-[A-Za-z0-9_-]{32,}")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TREADLE_")}
    env.update(TREADLE_DATA_DIR=str(tmp_path / "data"), COLUMNS="200")
    env.update(extra)
    return env


def _run(tmp_path: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CLI, *args], env=_env(tmp_path, **extra), capture_output=True, text=True, timeout=120
    )


def test_serve_prints_where_it_listens_and_a_working_key(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [CLI, "serve", "--port", str(port)],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 90
        while not any("Uvicorn running on" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stdout.readline())
        output = "".join(lines)
        assert f"http://127.0.0.1:{port}" in output
        match = KEY_RE.search(output)
        assert match, output
        response = httpx.post(
            f"http://127.0.0.1:{port}/api/v1/create_session",
            json={},
            headers={"X-API-Key": match.group(0)},
        )
        assert response.status_code == 200, response.text
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    key_file = tmp_path / "data" / "default-api-key"
    assert key_file.stat().st_mode & 0o077 == 0  # readable by its owner only
    assert key_file.read_text().strip() == match.group(0)


def _serve_until_listening(tmp_path: Path) -> str:
    """Start `treadle-server serve`, wait until it listens, stop it; its output."""
    proc = subprocess.Popen(
        [CLI, "serve", "--port", str(free_port())],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 90
        while not any("Uvicorn running on" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stdout.readline())
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    return "".join(lines)


def test_serve_shows_the_key_once_and_keeps_its_files_private(tmp_path: Path) -> None:
    first = _serve_until_listening(tmp_path)
    key_file = tmp_path / "data" / "default-api-key"
    key = key_file.read_text().strip()
    assert key in first
    again = _serve_until_listening(tmp_path)
    assert not KEY_RE.search(again), again
    assert str(key_file) in again and "treadle-server admin keys create default" in again
    data = tmp_path / "data"
    for path in (data, data / "artifacts"):
        assert path.stat().st_mode & 0o777 == 0o700, path
    for path in (key_file, data / "server-secret", *data.glob("treadle.db*")):
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert (data / "treadle.db").exists()


def test_serve_names_the_variables_each_client_reads(tmp_path: Path) -> None:
    output = _serve_until_listening(tmp_path)
    key_file = tmp_path / "data" / "default-api-key"
    for variables in (
        ("TREADLE_BASE_URL", "TREADLE_API_KEY"),
        ("TINKER_BASE_URL", "TINKER_API_KEY"),
    ):
        line = next(line for line in output.splitlines() if variables[0] in line)
        assert f"{variables[0]}=http://127.0.0.1:" in line, output
        assert f"{variables[1]}=$(cat {key_file})" in line, output


def test_admin_commands_manage_tenants_and_keys(tmp_path: Path) -> None:
    assert _run(tmp_path, "migrate").returncode == 0
    created = _run(
        tmp_path,
        "admin",
        "tenants",
        "create",
        "acme",
        "--max-sessions",
        "3",
        "--max-lora-rank",
        "32",
        "--spend-limit",
        "12.5",
    )
    assert created.returncode == 0, created.stderr
    duplicate = _run(tmp_path, "admin", "tenants", "create", "acme")
    assert duplicate.returncode == 2
    assert "already exists" in duplicate.stderr

    key_run = _run(tmp_path, "admin", "keys", "create", "acme", "--name", "laptop")
    assert key_run.returncode == 0, key_run.stderr
    key = key_run.stdout.strip()
    assert KEY_RE.fullmatch(key)
    key_id = key.split("-")[1]

    listing = _run(tmp_path, "admin", "keys", "list").stdout
    assert key_id in listing and "laptop" in listing
    assert key.split("-", 2)[2] not in listing  # the secret is never shown again
    tenants = _run(tmp_path, "admin", "tenants", "list").stdout
    assert "acme" in tenants and "12.50" in tenants

    assert (
        _run(tmp_path, "admin", "tenants", "update", "acme", "--max-sessions", "5").returncode == 0
    )
    assert _run(tmp_path, "admin", "keys", "revoke", key_id).returncode == 0
    assert re.search(
        rf"{key_id}.*\d{{4}}-\d\d-\d\dT", _run(tmp_path, "admin", "keys", "list").stdout
    )
    missing = _run(tmp_path, "admin", "keys", "revoke", "000000000000")
    assert missing.returncode == 2 and "no API key" in missing.stderr
    bad_scope = _run(tmp_path, "admin", "keys", "create", "acme", "--scope", "root")
    assert bad_scope.returncode == 2 and "tenant, admin" in bad_scope.stderr


def test_serve_on_a_taken_port_fails_before_making_a_key(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run(tmp_path, "serve", "--port", str(port))
        by_variable = _run(tmp_path, "serve", TREADLE_PORT=str(port))
    for failed in (result, by_variable):
        output = failed.stdout + failed.stderr
        assert failed.returncode == 2, output
        assert f"port {port}" in output and "already in use" in output, output
        assert "--port" in output and "TREADLE_PORT" in output, output
        assert "Traceback" not in output and not KEY_RE.search(output), output
        assert "API key" not in output, output
    assert not (tmp_path / "data" / "default-api-key").exists()


def test_admin_lists_show_ids_whole_in_a_narrow_terminal(tmp_path: Path) -> None:
    name = "a-tenant-with-a-rather-long-name"
    assert _run(tmp_path, "admin", "tenants", "create", name).returncode == 0
    key = _run(tmp_path, "admin", "keys", "create", name, "--name", "laptop").stdout.strip()
    key_id = key.split("-")[1]
    narrow = {"COLUMNS": "40"}
    keys = _run(tmp_path, "admin", "keys", "list", **narrow)
    tenants = _run(tmp_path, "admin", "tenants", "list", **narrow)
    assert keys.returncode == 0 and tenants.returncode == 0, keys.stderr + tenants.stderr
    tenant_id = re.search(r"tn_[0-9a-f]{16}", tenants.stdout)
    assert tenant_id, tenants.stdout
    for listing in (keys.stdout, tenants.stdout):
        assert name in listing and "…" not in listing, listing
    assert key_id in keys.stdout, keys.stdout
    # The ids as listed are the ones the other commands take.
    assert _run(tmp_path, "admin", "keys", "revoke", key_id).returncode == 0
    assert _run(tmp_path, "admin", "tenants", "update", name, "--max-sessions", "2").returncode == 0
    revoked = _run(tmp_path, "admin", "keys", "list", "--tenant", name, **narrow).stdout
    assert re.search(rf"{key_id} .*\d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\d\S* +│$", revoked, re.M), revoked


def test_distributed_mode_requires_an_explicit_secret(tmp_path: Path) -> None:
    distributed = {
        "TREADLE_REDIS_URL": "redis://127.0.0.1:1",
        "TREADLE_DATABASE_URL": f"sqlite:///{tmp_path / 'd.db'}",
    }
    assert _run(tmp_path, "migrate", **distributed).returncode == 0
    result = _run(tmp_path, "admin", "keys", "create", "x", **distributed)
    assert result.returncode == 2
    assert "needs TREADLE_SERVER_SECRET" in result.stderr
    weak = _run(
        tmp_path, "admin", "keys", "create", "x", TREADLE_SERVER_SECRET="changeme", **distributed
    )
    assert "too weak" in weak.stderr


def test_key_material_never_reaches_logs_or_the_database(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from tests.builders import make_settings, tenant_factory

    caplog.set_level(logging.DEBUG)
    db_path = tmp_path / "keys.db"
    settings = make_settings(tmp_path, f"sqlite:///{db_path}").model_copy(
        update={"database_url": None, "data_dir": tmp_path}
    )
    app = create_app(settings)
    tenant = tenant_factory(app.state.treadle.database, settings)()
    with TestClient(app) as client:
        headers = {"X-API-Key": tenant.key}
        session_id = client.post("/api/v1/create_session", json={}, headers=headers).json()[
            "session_id"
        ]
        client.post("/api/v1/session_heartbeat", json={"session_id": session_id}, headers=headers)
        client.post("/api/v1/create_session", json={"bogus": 1}, headers=headers)
        client.post("/api/v1/create_session", json={}, headers={"X-API-Key": tenant.key + "x"})
    app.state.treadle.database.dispose()
    secret = tenant.key.split("-", 2)[2]
    for needle in (tenant.key, secret):
        assert needle not in caplog.text
        for path in tmp_path.glob("treadle.db*"):  # the database file, WAL included
            assert needle.encode() not in path.read_bytes(), path
