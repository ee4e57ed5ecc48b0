"""The liveness file and `treadle-server probe`: a file the loop of a worker or beat touches, and
the exec probe that reads its age. The probe runs every few seconds beside a busy worker, so it
must stay cheap: it loads no engine and reads no settings or database."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from api.cli import app
from core import liveness

pytestmark = pytest.mark.unit


def backdate(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_touch_creates_the_file_and_its_folder(tmp_path: Path) -> None:
    path = tmp_path / "run" / "alive"
    liveness.touch(path)
    assert path.is_file()
    assert liveness.staleness(path, 60) is None


def test_touch_renews_a_stale_file(tmp_path: Path) -> None:
    path = tmp_path / "alive"
    liveness.touch(path)
    backdate(path, 600)
    assert liveness.staleness(path, 60) is not None
    liveness.touch(path)
    assert liveness.staleness(path, 60) is None


def test_touch_without_a_file_does_nothing(tmp_path: Path) -> None:
    liveness.touch(None)
    assert list(tmp_path.iterdir()) == []


def test_a_file_that_cannot_be_touched_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="core.liveness"):
        liveness.touch(blocker / "alive")
    assert f"cannot touch the liveness file {blocker / 'alive'}" in caplog.text


def test_staleness_names_the_file_and_why(tmp_path: Path) -> None:
    path = tmp_path / "alive"
    missing = liveness.staleness(path, 60)
    assert missing is not None and str(path) in missing and "does not exist" in missing
    path.touch()
    backdate(path, 125)
    stale = liveness.staleness(path, 60)
    assert stale is not None and str(path) in stale and "more than 60 s" in stale
    assert liveness.staleness(path, 600) is None


def test_a_file_touched_in_the_future_counts_as_fresh(tmp_path: Path) -> None:
    path = tmp_path / "alive"
    path.touch()
    backdate(path, -3600)
    assert liveness.staleness(path, 60) is None


@pytest.mark.parametrize(
    ("age", "exit_code"), [(None, 0), (5, 0), (120, 1), ("missing", 1)], ids=str
)
def test_probe_exits_0_only_for_a_fresh_file(
    tmp_path: Path, age: float | str | None, exit_code: int
) -> None:
    path = tmp_path / "alive"
    if age != "missing":
        path.touch()
        if isinstance(age, int):
            backdate(path, age)
    result = CliRunner().invoke(app, ["probe", "--file", str(path), "--max-age", "60"])
    assert result.exit_code == exit_code, result.output
    if exit_code:
        (line,) = result.output.splitlines()
        assert line.startswith("not alive: ") and str(path) in line


def test_probe_loads_no_engine_and_reads_no_settings(tmp_path: Path) -> None:
    """As the real command: a settings value that cannot be parsed would fail any command that
    builds `Settings`, and an unreachable database any that opens it."""
    path = tmp_path / "alive"
    path.touch()
    code = (
        "import sys\n"
        "from api.cli import app\n"
        "try:\n"
        "    app(sys.argv[1:])\n"
        "except SystemExit as stop:\n"
        "    assert 'torch' not in sys.modules, 'the probe imported torch'\n"
        "    assert 'psycopg' not in sys.modules, 'the probe loaded the database driver'\n"
        "    raise\n"
    )
    env = {
        **os.environ,
        "TREADLE_PORT": "not-a-port",
        "TREADLE_DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:1/none",
    }
    args = [sys.executable, "-c", code, "probe", "--file", str(path), "--max-age", "60"]
    fresh = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert fresh.returncode == 0, fresh.stderr
    backdate(path, 120)
    stale = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert stale.returncode == 1, stale.stderr
    assert stale.stderr.startswith("not alive: ")
