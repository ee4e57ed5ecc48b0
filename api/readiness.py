"""Readiness: whether this API replica can do its work, for load balancers (`GET /readyz`).

A background loop checks the database (reachable, migrations at head) and, in distributed mode,
Redis, every `readiness_check_seconds`; probes read the last round's result and cost nothing.
Each round runs in its own thread with short timeouts and a bound on the whole round; a round
that hangs past it counts as failed, and no new round starts until it ends, so a stuck database
cannot pile up threads. Liveness (`/healthz`) deliberately knows nothing of this: a replica
whose database is down should leave the pool, not be restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import redis
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from api import dbschema
from core.db import Database
from core.settings import Mode, Settings

logger = logging.getLogger(__name__)

DATABASE_TIMEOUT_SECONDS = 2
REDIS_TIMEOUT_SECONDS = 1.0
# Connect and statement timeouts of both checks fit in it, with a little to spare.
ROUND_TIMEOUT_SECONDS = 4.0
# A last round older than this many intervals (plus the grace) means the loop itself is stuck.
STALE_INTERVALS = 3
STALE_GRACE_SECONDS = 2.0

Checks = dict[str, str]
"""Each check's name and `"ok"`, or a short reason it failed (safe to show anyone)."""

OK = "ok"


@dataclasses.dataclass(frozen=True)
class Report:
    ready: bool
    checks: Checks


class Readiness:
    """The checks, their last result, and the loop that refreshes it."""

    def __init__(
        self,
        settings: Settings,
        database: Database,
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._monotonic = monotonic
        self._interval = settings.readiness_check_seconds
        self._database = database
        self._head = dbschema.head_revision(database)
        self._engine = _probe_engine(database)
        self._redis = (
            redis.Redis.from_url(
                settings.redis_url,
                socket_timeout=REDIS_TIMEOUT_SECONDS,
                socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
            )
            if settings.mode is Mode.DISTRIBUTED and settings.redis_url
            else None
        )
        self._last: tuple[float, Checks] | None = None  # (monotonic end time, checks)
        self._in_flight: asyncio.Future[Checks] | None = None
        # The last failed checks' full errors, for the log only: they may name hosts.
        self._errors: dict[str, str] = {}

    @property
    def names(self) -> list[str]:
        return ["database", "migrations", *(["redis"] if self._redis is not None else [])]

    def report(self) -> Report:
        """The last round's result; not ready before the first round or when it is stale."""
        if self._last is None:
            return Report(False, dict.fromkeys(self.names, "not checked yet"))
        finished, checks = self._last
        age = self._monotonic() - finished
        if age > STALE_INTERVALS * self._interval + STALE_GRACE_SECONDS:
            return Report(False, dict.fromkeys(self.names, f"last checked {age:.0f} s ago"))
        return Report(all(result == OK for result in checks.values()), dict(checks))

    async def run_periodically(self) -> None:
        while True:
            await self.run_round()
            await asyncio.sleep(self._interval)

    async def run_round(self) -> None:
        if self._in_flight is not None and not self._in_flight.done():
            checks = dict.fromkeys(self.names, "the previous check has not finished")
        else:
            self._in_flight = _in_thread(self.check)
            # `asyncio.wait`, not `wait_for`: it leaves a hung round running, and a cancellation
            # (the app stopping) always propagates, which Python 3.11's `wait_for` may swallow
            # when the round ends at the same moment (then this loop would never stop).
            done, _ = await asyncio.wait({self._in_flight}, timeout=ROUND_TIMEOUT_SECONDS)
            checks = (
                self._in_flight.result()
                if done
                else dict.fromkeys(self.names, f"no answer within {ROUND_TIMEOUT_SECONDS:g} s")
            )
        previous = self._last[1] if self._last else None
        if checks != previous and any(result != OK for result in checks.values()):
            logger.warning("not ready: %s (%s)", checks, self._errors)
        elif previous is not None and checks != previous:
            logger.info("ready again")
        self._last = (self._monotonic(), checks)

    def check(self) -> Checks:
        """One round, blocking: each check's result, never raising."""
        checks: Checks = {}
        errors: dict[str, str] = {}
        try:
            with self._engine.connect() as conn:
                conn.execute(text("SELECT 1"))
                checks["database"] = OK
                current = MigrationContext.configure(conn).get_current_revision()
            checks["migrations"] = (
                OK
                if current == self._head
                else f"the database is at revision {current or 'none'}, this server needs "
                f"{self._head}; run `treadle-server migrate`"
            )
        except Exception as exc:
            errors["database"] = str(exc)
            if self._engine is not self._database.engine:
                self._engine.dispose()  # its connection may be broken: the next round connects
            if "database" in checks:
                checks["migrations"] = f"unreadable ({type(exc).__name__})"
            else:
                checks["database"] = f"unreachable ({type(exc).__name__})"
                checks["migrations"] = "unknown: the database is unreachable"
        if self._redis is not None:
            try:
                self._redis.ping()
                checks["redis"] = OK
            except Exception as exc:
                errors["redis"] = str(exc)
                checks["redis"] = f"unreachable ({type(exc).__name__})"
        self._errors = errors
        return checks

    def close(self) -> None:
        if self._engine is not self._database.engine:
            self._engine.dispose()
        if self._redis is not None:
            self._redis.close()


def _probe_engine(database: Database) -> Engine:
    """An engine whose connections give up quickly. SQLite is a local file, read without locks
    in WAL mode: the app's own engine will do."""
    if database.is_sqlite:
        return database.engine
    milliseconds = DATABASE_TIMEOUT_SECONDS * 1000
    return create_engine(
        database.url,
        pool_size=1,
        max_overflow=0,
        pool_timeout=DATABASE_TIMEOUT_SECONDS,
        connect_args={
            "connect_timeout": DATABASE_TIMEOUT_SECONDS,
            "options": f"-c statement_timeout={milliseconds}",
        },
    )


def _in_thread(work: Callable[[], Checks]) -> asyncio.Future[Checks]:
    """`work()` in a daemon thread (a hung check must not hold up the process's exit, as the
    event loop's own executor would), its result delivered to the running loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Checks] = loop.create_future()

    def deliver(checks: Checks) -> None:
        if not future.done():
            future.set_result(checks)

    def run() -> None:
        checks = work()
        with contextlib.suppress(RuntimeError):  # the loop closed while the round hung
            loop.call_soon_threadsafe(deliver, checks)

    threading.Thread(target=run, name="readiness-checks", daemon=True).start()
    return future
