"""Database engine and sessions, for PostgreSQL (production) and SQLite (embedded mode).

The schema is owned by Alembic (`migrations/`); this module never creates tables. It offers
`Database.transaction()` for work that writes, `Database.reader()` for work that only reads, and
`Database.rows()` for the hot reads that need no ORM objects.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session, sessionmaker

_SQLITE_BEGIN = "treadle_sqlite_begin"


def make_engine(url: str, **kwargs: Any) -> Engine:
    if url.startswith("sqlite"):
        _create_private(make_url(url).database)
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": 30},
            **kwargs,
        )
        _configure_sqlite(engine)
        return engine
    kwargs.setdefault("pool_size", 10)
    kwargs.setdefault("max_overflow", 40)
    engine = create_engine(url, **kwargs)
    _ping_when_idle(engine)
    return engine


def _create_private(database: str | None) -> None:
    """Create a SQLite file readable by its owner alone (0600) before SQLite does (0644 under the
    usual umask): it holds key hashes and every tenant's records. SQLite gives its WAL and
    shared-memory files the database file's mode."""
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    # A missing folder is left for SQLite to report, as it always has.
    with contextlib.suppress(FileExistsError, FileNotFoundError):
        os.close(os.open(database, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


PING_AFTER_IDLE_SECONDS = 5.0
"""A pooled PostgreSQL connection idle this long is checked before use."""


def _ping_when_idle(engine: Engine) -> None:
    """Check a pooled connection before use once it has been idle `PING_AFTER_IDLE_SECONDS`
    (the server may have restarted, or a firewall dropped it meanwhile); a dead one is replaced
    before the caller sees it. A connection in steady use is not pinged: that would add a round
    trip to every transaction. If the server goes away while connections are busy, the
    statement that finds out fails, and SQLAlchemy then replaces every connection of the pool
    (on PostgreSQL a restart ends the transactions in progress anyway)."""

    @event.listens_for(engine, "connect")
    def _connected(_dbapi_connection: Any, record: Any) -> None:
        record.info[_CHECKED_IN] = time.monotonic()

    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_connection: Any, record: Any) -> None:
        if record is not None:
            record.info[_CHECKED_IN] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        if time.monotonic() - record.info.get(_CHECKED_IN, 0.0) < PING_AFTER_IDLE_SECONDS:
            return
        try:
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute("SELECT 1")
            finally:
                cursor.close()
            dbapi_connection.rollback()
        except Exception as exc:
            # The pool discards this connection and checks out another (SQLAlchemy's recipe).
            raise DisconnectionError(f"a pooled connection was dead: {exc}") from exc


_CHECKED_IN = "treadle_checked_in"


def _configure_sqlite(engine: Engine) -> None:
    # pysqlite's own transaction handling defers BEGIN and cannot take a write lock up front,
    # so SQLAlchemy's documented recipe takes over: autocommit at the driver, explicit BEGIN.
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        mode = conn.get_execution_options().get(_SQLITE_BEGIN, "DEFERRED")
        if mode is not None:  # None: each statement on its own (the driver autocommits)
            conn.exec_driver_sql(f"BEGIN {mode}")


class Database:
    def __init__(self, url: str, **engine_kwargs: Any) -> None:
        self.url = url
        self.engine = make_engine(url, **engine_kwargs)
        self._readers = sessionmaker(self.engine, expire_on_commit=False)
        # The same pool; on SQLite its transactions begin IMMEDIATE (see `transaction`).
        # Options set once here rather than on each session's connection, which would copy it.
        writes = self.engine.execution_options(**{_SQLITE_BEGIN: "IMMEDIATE"})
        self._writers = sessionmaker(writes, expire_on_commit=False)
        # Statements each on their own, no transaction around them: on PostgreSQL that spares a
        # BEGIN and a ROLLBACK, a round trip each (SQLite's driver autocommits already; setting
        # its isolation level would undo that).
        self._statements = self.engine.execution_options(
            **({_SQLITE_BEGIN: None} if self.is_sqlite else {"isolation_level": "AUTOCOMMIT"})
        )

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """A session whose transaction commits on success and rolls back on error.

        On SQLite the write lock is taken at BEGIN: a deferred transaction that reads and then
        writes fails with "database is locked" when another writer got in between, whatever the
        busy timeout. On PostgreSQL callers lock the rows they depend on (`FOR UPDATE`).
        """
        with self._begin(self._writers) as session:
            yield session

    @contextmanager
    def reader(self) -> Iterator[Session]:
        """A read-only transaction; never blocks writers (WAL on SQLite, MVCC on PostgreSQL)."""
        with self._begin(self._readers) as session:
            yield session

    @contextmanager
    def rows(self) -> Iterator[Connection]:
        """A plain connection for the reads every request makes, which run prebuilt Core
        statements and need no ORM objects: without an ORM session a short read costs about a
        third as much. Each statement runs on its own, in no transaction, so it sees what was
        committed when it ran, as each statement of a `reader()` does on PostgreSQL (read
        committed): a caller that reads twice must not need the two reads to agree."""
        with self._statements.connect() as connection:
            yield connection

    @contextmanager
    def _begin(self, sessions: sessionmaker[Session]) -> Iterator[Session]:
        # The transaction begins with the session's first statement (BEGIN IMMEDIATE on SQLite
        # for writers, so the write lock is taken before anything is read).
        with sessions() as session:
            try:
                yield session
                session.commit()
            except BaseException:
                session.rollback()
                raise

    def dispose(self) -> None:
        self.engine.dispose()
