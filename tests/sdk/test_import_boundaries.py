"""`treadle` stays a light client: no tinker, torch, numpy or server packages on import."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

FORBIDDEN = ("tinker", "torch", "numpy", "api", "core", "scheduler", "billing", "gpu_worker")


def test_importing_treadle_pulls_in_nothing_heavy() -> None:
    code = (
        "import sys, treadle, treadle.types, treadle.wire, treadle.proto\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == ""
