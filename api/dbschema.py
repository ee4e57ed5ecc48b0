"""Schema management through Alembic: upgrade, downgrade, and the at-head check.

The application never creates tables itself; `treadle-server migrate` (or embedded start-up)
runs the revisions in `migrations/`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from importlib import resources

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.script.revision import RevisionError
from alembic.util import CommandError

from core import logs
from core.db import Database
from core.errors import DatabaseNotMigrated
from core.settings import Settings


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(resources.files("migrations")))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(db: Database, revision: str = "head") -> None:
    with _migrating(db) as config, _logged(config, revision, upgrading=True):
        command.upgrade(config, revision)


def downgrade(db: Database, revision: str = "base") -> None:
    with _migrating(db) as config, _logged(config, revision, upgrading=False):
        command.downgrade(config, revision)


def _logged(
    config: Config, revision: str, *, upgrading: bool
) -> contextlib.AbstractContextManager[None]:
    """Alembic's lines when revisions are to run; none when the database is already at
    `revision`, as on most starts (`core.logs` quiets them otherwise)."""
    current = MigrationContext.configure(config.attributes["connection"]).get_current_revision()
    upper, lower = (revision, current or "base") if upgrading else (current or "base", revision)
    try:
        pending = any(ScriptDirectory.from_config(config).iterate_revisions(upper, lower))
    except (CommandError, RevisionError):
        pending = True  # a target alembic cannot order: the command itself says what is wrong
    return logs.migration_log() if pending else contextlib.nullcontext()


@contextlib.contextmanager
def _migrating(db: Database) -> Iterator[Config]:
    """One transaction for the revisions. On SQLite, foreign keys are off while they run (SQLite
    changes a column by copying its table, and dropping the old copy of a table that other rows
    reference would fail) and checked before the commit, as SQLite's own procedure for schema
    changes does; the setting only takes effect outside a transaction."""
    config = alembic_config(db.url)
    with db.engine.connect() as conn:
        sqlite = conn.dialect.name == "sqlite"
        if sqlite:
            conn.connection.dbapi_connection.execute("PRAGMA foreign_keys=OFF")  # type: ignore[union-attr]
        try:
            with conn.begin():
                config.attributes["connection"] = conn
                yield config
                if sqlite:
                    broken = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                    if broken:
                        raise RuntimeError(
                            f"the migration left rows with dangling references: {broken[:5]}"
                        )
        finally:
            if sqlite:
                conn.connection.dbapi_connection.execute("PRAGMA foreign_keys=ON")  # type: ignore[union-attr]


def head_revision(db: Database) -> str | None:
    return ScriptDirectory.from_config(alembic_config(db.url)).get_current_head()


def current_revision(db: Database) -> str | None:
    with db.engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def require_head(db: Database) -> None:
    current, head = current_revision(db), head_revision(db)
    if current != head:
        state = "has no Treadle schema" if current is None else f"is at revision {current}"
        raise DatabaseNotMigrated(
            f"the database {db.engine.url.render_as_string(hide_password=True)} {state}, "
            f"but this server needs revision {head}; run `treadle-server migrate` first"
        )


def open_database(settings: Settings) -> Database:
    """The settings' database, ready for use. The embedded SQLite file (no database URL set)
    belongs to Treadle: it is made private and upgraded here. Any other database must already
    be at the head revision (`treadle-server migrate`)."""
    if settings.database_url is None:
        settings.ensure_data_dir()  # first, so the SQLite file is made private in it
    database = Database(settings.resolved_database_url)
    if settings.database_url is None:
        upgrade(database)
    require_head(database)
    return database
