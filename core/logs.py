"""Logging for every Treadle process: one handler on the root logger, in the format and at the
level the settings name (`TREADLE_LOG_FORMAT`, `TREADLE_LOG_LEVEL`).

Text lines are for people (`2026-12-01T19:55:45.123Z INFO scheduler.beat message`); JSON lines
are for log collectors, one object per line with the `extra` fields a call passes (request_id,
tenant_id, run_id, ...). The libraries' loggers (uvicorn's, Celery's, alembic's) propagate to
the same handler, so every line of a process has one shape. Alembic's per-connection lines are
quiet unless a migration runs (`migration_log`), and `Outage` turns a dependency that fails on
every call into two lines: when it starts failing and when it works again.

This module decides how lines look and which are worth showing; it knows nothing of what the
callers log, nor of requests and tenants beyond the field names they pass.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from core.settings import Settings

UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")
# Alembic logs "Context impl ..." and "Will assume transactional DDL" whenever it reads the
# schema version (every readiness round, every start), not only when it migrates.
MIGRATION_LOGGER = "alembic.runtime.migration"

# What a LogRecord holds of its own: anything else on a record came from `extra`.
_RECORD_FIELDS = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}
# Uvicorn passes its messages again with terminal colours, for its own formatter.
_IGNORED_EXTRAS = frozenset({"color_message"})


def _timestamp(record: logging.LogRecord) -> str:
    moment = datetime.fromtimestamp(record.created, UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class TextFormatter(logging.Formatter):
    """`<ISO UTC time> <LEVEL> <logger> <message>`, a traceback on the lines below."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname} {record.name} {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, exc_info when there is one, and the
    call's `extra` fields (values JSON cannot hold are written as their `str`)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack_info"] = self.formatStack(record.stack_info)
        for name, value in record.__dict__.items():
            if name not in _RECORD_FIELDS and name not in _IGNORED_EXTRAS and name not in entry:
                entry[name] = value
        return json.dumps(entry, default=str, ensure_ascii=False)


class _TreadleHandler(logging.StreamHandler):
    """Marks the handler `configure` installs, so configuring again replaces it and nothing
    else (a test runner's capture handler stays). It writes to whatever `sys.stderr` is when a
    line is emitted, not to the stream of the moment it was made: a command run in-process (a
    test's CLI runner) swaps stderr and closes its own afterwards."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


def configure(settings: Settings) -> None:
    """Send every logger's lines to stderr in `settings.log_format`, at `settings.log_level`."""
    handler = _TreadleHandler()
    handler.setFormatter(JsonFormatter() if settings.log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _TreadleHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(settings.log_level)
    for name in UVICORN_LOGGERS:
        # Uvicorn's own configuration (when anything applied it) gives these loggers
        # handlers of their own and stops them propagating: undo it, the root's handler serves.
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers.clear()
        uvicorn_logger.propagate = True
        uvicorn_logger.setLevel(logging.NOTSET)
    logging.getLogger(MIGRATION_LOGGER).setLevel(logging.WARNING)
    # Libraries' warnings (Celery's among them) become log lines in the same format.
    logging.captureWarnings(True)


@contextlib.contextmanager
def migration_log() -> Iterator[None]:
    """Alembic's INFO lines (its context, then each revision it runs) while migrations run."""
    migration = logging.getLogger(MIGRATION_LOGGER)
    previous = migration.level
    migration.setLevel(logging.INFO)
    try:
        yield
    finally:
        migration.setLevel(previous)


class Outage:
    """One caller's view of a dependency it uses again and again (Redis, on every request or
    loop turn): the first failure is logged at WARNING with its error and what it costs, the
    failures after it at DEBUG, and the first success after them at INFO. An outage is then
    two lines, not one per request. Safe to share between threads."""

    def __init__(self, logger: logging.Logger, action: str, consequence: str) -> None:
        """`action` names what failed ("publishing on Redis"); `consequence` says what its
        failing costs ("waiters see results on their next poll")."""
        self._logger = logger
        self._action = action
        self._consequence = consequence
        self._lock = threading.Lock()
        self._failing = False

    @property
    def failing(self) -> bool:
        return self._failing

    def failed(self, error: BaseException) -> None:
        with self._lock:
            first, self._failing = not self._failing, True
        reason = f"{type(error).__name__}: {error}"
        if first:
            self._logger.warning(
                "%s failed (%s); %s. Logged again when it works",
                self._action,
                reason,
                self._consequence,
            )
        else:
            self._logger.debug("%s failed again (%s)", self._action, reason)

    def succeeded(self) -> None:
        with self._lock:
            recovered, self._failing = self._failing, False
        if recovered:
            self._logger.info("%s works again", self._action)
