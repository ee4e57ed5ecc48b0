"""The import arrows of DESIGN.md §2 hold, the light packages never load torch (nor the S3
clients, which only an S3 artifact store imports), and
docs/architecture.md lists the packages there are."""

from __future__ import annotations

import re
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
        "heavy = sorted(m for m in ('torch', 'transformers', 'peft', 'boto3', 'botocore', 's3fs')"
        " if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def _documented_packages() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Packages and import arrows", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([^`]+/)` \|", section, flags=re.MULTILINE))


def _packages_in_tree() -> set[str]:
    roots = [
        "api",
        "billing",
        "core",
        "gpu_worker",
        "migrations",
        "scheduler",
        "sdk/treadle",
        "cookbook/treadle_cookbook",
    ]
    return {
        init.parent.relative_to(ROOT).as_posix() + "/"
        for root in roots
        for init in (ROOT / root).rglob("__init__.py")
    }


def test_the_package_table_matches_the_tree() -> None:
    documented, actual = _documented_packages(), _packages_in_tree()
    assert documented == actual, (
        f"docs/architecture.md lists packages that do not exist: {sorted(documented - actual)}; "
        f"and misses: {sorted(actual - documented)}"
    )
