"""The engine's import arrows (DESIGN §2): no core, api, billing or scheduler; no print."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gpu_worker

pytestmark = pytest.mark.unit

FORBIDDEN = {"core", "api", "billing", "scheduler"}
PACKAGE = Path(gpu_worker.__file__).resolve().parent


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", modules(), ids=lambda p: p.name)
def test_no_forbidden_imports_and_no_print(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id != "print", f"{path.name} calls print(); use logging"
