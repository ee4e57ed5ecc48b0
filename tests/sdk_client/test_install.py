"""`pip install ./sdk` into a fresh virtual environment pulls no torch and no transformers, nor
the `treadle` command's typer and rich (the `cli` extra)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SDK = Path(__file__).resolve().parents[2] / "sdk"
HEAVY = {"torch", "transformers", "numpy", "tokenizers", "tinker", "peft"}
CLI_ONLY = {"typer", "rich", "click"}


def _install(tmp_path: Path, *pip_args: str) -> Path:
    """A fresh virtual environment with the SDK installed by `pip install *pip_args <sdk>`;
    returns the environment's folder."""
    # Install from a clean copy: pip builds in the source tree and would leave build/ behind.
    source = tmp_path / "sdk"
    shutil.copytree(
        SDK, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    install = subprocess.run(
        [
            *(str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"),
            *("--disable-pip-version-check", *pip_args, str(source)),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=tmp_path,
    )
    assert install.returncode == 0, install.stderr[-4000:]
    return venv


def test_pip_install_is_light(tmp_path: Path) -> None:
    venv = _install(tmp_path)
    python = str(venv / "bin" / "python")
    listed = subprocess.run(
        [python, "-m", "pip", "list", "--format=json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    installed = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "treadle" in installed
    assert not installed & HEAVY, sorted(installed & HEAVY)
    assert not installed & CLI_ONLY, sorted(installed & CLI_ONLY)
    smoke = subprocess.run(
        [python, "-c", "import treadle, treadle.types, treadle.wire; print('ok')"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,  # never the source tree
    )
    assert smoke.stdout.strip() == "ok", smoke.stderr
    command = [str(venv / "bin" / "treadle"), "--help"]
    hint = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert hint.returncode == 1, hint.stdout + hint.stderr
    assert hint.stdout == "" and len(hint.stderr.splitlines()) == 1, hint.stderr
    assert "pip install 'treadle[cli]'" in hint.stderr, hint.stderr

    # The extra brings the command.
    extra = subprocess.run(
        [
            *(python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"),
            f"{tmp_path / 'sdk'}[cli]",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=tmp_path,
    )
    assert extra.returncode == 0, extra.stderr[-4000:]
    cli = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert cli.returncode == 0 and "checkpoints" in cli.stdout, cli.stdout + cli.stderr


def test_an_editable_install_is_visible_to_type_checkers(tmp_path: Path) -> None:
    python = str(_install(tmp_path, "--no-deps", "--editable") / "bin" / "python")
    snippet = tmp_path / "loop.py"
    snippet.write_text(
        "import treadle\n\n\n"
        "def step(trainer: treadle.TrainingClient) -> None:\n"
        "    trainer.forward_backward([], loss_fn='cross_entropy')\n"
        "    trainer.optim_step(1e-3)\n"
    )
    checked = subprocess.run(
        [
            *(sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--config-file"),
            *("/dev/null", "--python-executable", python, str(snippet)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,  # never the source tree
    )
    # mypy reads the package's own annotations: the one mistake in the snippet is found.
    assert "import-not-found" not in checked.stdout and "import-untyped" not in checked.stdout
    assert 'incompatible type "float"; expected "AdamParams | None"' in checked.stdout
    assert "Found 1 error" in checked.stdout, checked.stdout
