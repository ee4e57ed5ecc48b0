"""When a periodic job is due in this process.

Periodic jobs (billing's, op-log retention, artifact collection) run from whichever loop a
deployment has: the embedded server's tasks, or `treadle-server beat`'s tick. Each may be called
as often as its loop ticks; `due` says whether the job's interval has passed since it last ran
here on that database. Every job is idempotent, so a second process running it changes nothing.
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta

from core.db import Database

_lock = threading.Lock()
_last_run: dict[tuple[str, str], datetime] = {}


def due(job: str, database: Database, now: datetime, every_seconds: float) -> bool:
    """Whether `job` should run now on `database`; if so, it counts as run from now on."""
    key = (job, database.url)
    with _lock:
        last = _last_run.get(key)
        if last is not None and last <= now < last + timedelta(seconds=every_seconds):
            return False
        _last_run[key] = now
        return True
