"""The import arrows of DESIGN.md §2 hold, and the light packages never load torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "module",
    ["api", "api.app", "api.cli", "scheduler", "core", "billing", "treadle", "treadle.types"],
)
def test_module_imports_without_torch(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
