"""The committed API reference (sdk/docs/api.md) matches the docstrings it is generated from."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[2] / "sdk" / "scripts" / "gen_api_reference.py"


def test_api_reference_is_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_every_public_method_is_documented() -> None:
    import treadle

    undocumented = []
    for cls in (
        treadle.ServiceClient,
        treadle.TrainingClient,
        treadle.SamplingClient,
        treadle.RestClient,
        treadle.APIFuture,
    ):
        for name, member in cls.__dict__.items():
            if name.startswith("_") or not callable(member) or name.endswith("_async"):
                continue
            if not (member.__doc__ or "").strip():
                undocumented.append(f"{cls.__name__}.{name}")
    assert undocumented == []
