"""Alembic revisions go up and down on SQLite and PostgreSQL; servers refuse stale schemas."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import inspect

import billing.tables  # noqa: F401  (registers billing tables)
from api import dbschema
from api.app import create_app
from core.db import Database
from core.errors import DatabaseNotMigrated
from core.tables import Base
from tests.builders import make_settings

pytestmark = pytest.mark.integration

DESIGN_TABLES = {
    "tenants",
    "api_keys",
    "sessions",
    "training_runs",
    "sampling_sessions",
    "operations",
    "usage_events",
    "usage_rollups",
    "prices",
    "model_packages",
    "model_versions",
    "model_aliases",
    "workers",
    "audit_log",
}


def test_upgrade_to_head_and_back_to_empty(database_url: str) -> None:
    database = Database(database_url)
    dbschema.upgrade(database)
    tables = set(inspect(database.engine).get_table_names())
    assert tables >= DESIGN_TABLES
    assert dbschema.current_revision(database) == dbschema.head_revision(database)
    dbschema.require_head(database)

    dbschema.downgrade(database, "base")
    assert set(inspect(database.engine).get_table_names()) <= {"alembic_version"}
    assert dbschema.current_revision(database) is None

    dbschema.upgrade(database)  # and up again: downgrade left nothing behind
    assert set(inspect(database.engine).get_table_names()) >= DESIGN_TABLES


def test_migrations_match_the_models(database_url: str) -> None:
    """Autogenerate finds nothing to do: the revisions create exactly what the models declare."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    database = Database(database_url)
    dbschema.upgrade(database)
    with database.engine.connect() as conn:
        diff = compare_metadata(
            MigrationContext.configure(conn, opts={"compare_type": False}), Base.metadata
        )
    assert diff == []


def test_server_refuses_an_unmigrated_database(tmp_path: Path, database_url: str) -> None:
    settings = make_settings(tmp_path, database_url)
    with pytest.raises(DatabaseNotMigrated, match="run `treadle-server migrate`"):
        create_app(settings)


def test_embedded_default_database_is_migrated_on_start(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, "sqlite:///unused").model_copy(update={"database_url": None})
    app = create_app(settings)
    database = app.state.treadle.database
    assert dbschema.current_revision(database) == dbschema.head_revision(database)
    assert (tmp_path / "data" / "treadle.db").exists()
