"""Tests share helpers through helper modules, never through another test module or a conftest:
importing a test module runs its fixtures' registration twice, and a conftest is pytest's to
load. Fixtures stay in conftest files; what they and tests share lives beside them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parents[1]


def _imported(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    names += [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
    return names


def test_no_test_imports_a_test_module_or_a_conftest() -> None:
    found = [
        f"{path.relative_to(TESTS.parent)} imports {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for module in _imported(path)
        if module.startswith("tests.")
        and (module.rsplit(".", 1)[-1].startswith("test_") or module.endswith("conftest"))
    ]
    assert not found, "\n".join(found)
