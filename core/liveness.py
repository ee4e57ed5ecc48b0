"""Liveness of the processes that serve no HTTP: workers and beat.

Each touches a file from its main loop (a worker after every lease renewal, beat after every
tick) when `TREADLE_LIVENESS_FILE` names one; an exec probe (`treadle-server probe`, a Docker
healthcheck or a Kubernetes probe) then checks how long ago it was touched. The file's
modification time is the whole signal: its content is empty and nothing else reads it.

This module knows nothing of databases or engines, so that a probe stays cheap: it runs every
few seconds beside a worker that may hold every core.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)


def touch(path: Path | None) -> None:
    """Mark this process alive now: set `path`'s modification time, creating the file and its
    folder if needed. Nothing when `path` is None (no liveness file configured).

    A failure is logged, not raised: the loop that calls this has more important work than its
    probe, and the probe will report the file as missing or stale, naming it."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError as exc:
        log.warning("cannot touch the liveness file %s: %s", path, exc)


def forget(path: Path | None) -> None:
    """Remove a liveness file a previous run of the process left (a restarted container keeps
    its /tmp), so that the probe fails until this run's loop touches it."""
    if path is None:
        return
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot remove the stale liveness file %s: %s", path, exc)


def staleness(path: Path, max_age_seconds: float) -> str | None:
    """None when `path` was touched at most `max_age_seconds` ago, else one line saying why
    not. A modification time in the future (the clock was set back) counts as fresh."""
    try:
        touched = os.stat(path).st_mtime
    except FileNotFoundError:
        return (
            f"{path} does not exist: the process has not touched it yet, or its "
            "TREADLE_LIVENESS_FILE names another file"
        )
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    age = time.time() - touched
    if age > max_age_seconds:
        return f"{path} was last touched {age:.0f} s ago, more than {max_age_seconds:g} s"
    return None
