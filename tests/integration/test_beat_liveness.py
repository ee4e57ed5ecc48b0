"""Beat's loop, run for real on a migrated database: it touches its liveness file after each tick
and logs a heartbeat saying how many ticks ran and what it sees (live workers, queued ops)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from core.clock import FakeClock
from core.db import Database
from scheduler.beat import log_heartbeat, run_beat
from tests.builders import make_settings
from tests.scheduling import Rows, migrated

pytestmark = pytest.mark.integration


def test_beat_touches_its_liveness_file_and_logs_a_heartbeat(
    tmp_path: Path, sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    rows = Rows(migrated(sqlite_url))
    # A worker serving another model: the queued op stays queued, so no wake-up needs Redis.
    rows.worker("w-other", ["other/model"])
    rows.run(rows.tenant())
    alive = tmp_path / "run" / "beat-alive"
    settings = make_settings(tmp_path, sqlite_url, liveness_file=alive)
    stop = threading.Event()
    beat = threading.Thread(
        target=run_beat,
        args=(settings, rows.clock),
        kwargs={"interval_seconds": 0.05, "heartbeat_seconds": 0.0, "stop": stop},
    )
    with caplog.at_level(logging.INFO, logger="scheduler.beat"):
        beat.start()
        try:
            deadline = time.monotonic() + 60
            while "beat alive" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            stop.set()
            beat.join(timeout=60)
    assert not beat.is_alive(), "run_beat did not return once stopped"
    assert alive.is_file()
    (heartbeat, *_) = [r.getMessage() for r in caplog.records if "beat alive" in r.getMessage()]
    assert "(0 failed), 1 workers live, 1 ops queued" in heartbeat


def test_the_heartbeat_says_when_the_database_does_not_answer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gone = Database(f"sqlite:///{tmp_path / 'no-such-folder' / 'treadle.db'}")
    with caplog.at_level(logging.INFO, logger="scheduler.beat"):
        log_heartbeat(gone, FakeClock(), 150, 150, 300.0)
    assert "beat alive: 150 ticks in 300 s (150 failed), workers and queue unknown" in caplog.text
