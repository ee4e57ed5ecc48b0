"""A running embedded Treadle server per test module, for driving real clients."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server import LiveServer, start_server


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from start_server(tmp_path_factory.mktemp("server"))


@pytest.fixture(autouse=True)
def _no_stored_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
