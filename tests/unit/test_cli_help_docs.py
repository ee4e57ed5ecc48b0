"""`treadle-server worker --help`, `serve --help` and docs/configuration.md agree on where the
engine's device and models come from: the options name the settings they default to, and each
setting's row names the option that overrides it."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from api.cli import app

pytestmark = pytest.mark.unit

CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _help(command: str) -> str:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def _row(setting: str) -> str:
    rows = [
        line
        for line in CONFIGURATION.read_text().splitlines()
        if line.startswith(f"| `{setting}` |")
    ]
    assert len(rows) == 1, f"docs/configuration.md has {len(rows)} rows for {setting}"
    return rows[0]


@pytest.mark.parametrize(
    ("option", "setting"), [("--device", "TREADLE_DEVICE"), ("--models", "TREADLE_MODELS")]
)
def test_a_worker_option_and_its_setting_name_each_other(option: str, setting: str) -> None:
    option_help = _help("worker").split(option, 1)[1].split(" --", 1)[0]
    assert f"(default: {setting}" in option_help
    row = _row(setting)
    assert f"`treadle-server worker {option}" in row and "overrides it" in row, row
    # Read by both engines' processes, not by one of them only.
    assert "embedded server" in row and "worker" in row.split("`treadle-server")[0], row


def test_the_worker_group_size_option_and_its_setting_name_each_other() -> None:
    option_help = _help("worker").split("--group-size <", 1)[1].split(" --", 1)[0]
    assert "(default: TREADLE_WORKER_GROUP_SIZE, 1)" in option_help
    row = _row("TREADLE_WORKER_GROUP_SIZE")
    assert "`treadle-server worker --group-size` overrides it" in row, row


def test_serve_names_the_settings_its_engine_reads() -> None:
    text = _help("serve")
    assert "TREADLE_DEVICE (auto: the first GPU, else the CPU)" in text
    assert "TREADLE_MODELS" in text
