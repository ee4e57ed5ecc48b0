"""The model registry: named packages with descriptions and tags that can be deleted (freeing
their name), versions with their lineage and files, movable aliases, and op-log retention.

Existing versions get their package's base model and their run's session. Exports (kind
`external`) become `adapter` versions: an export made before this revision did not record
whether it was merged, and adapters were the default.

Revision ID: 0006
Revises: 0005
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TIME = sa.DateTime(timezone=True)
_LIVE = "deleted_at IS NULL"
_RUN_LIVE = "deleted_at IS NULL AND training_run_id IS NOT NULL"
_UNPRUNED = "payload_pruned_at IS NULL"


def upgrade() -> None:
    with op.batch_alter_table("model_packages", schema=None) as batch_op:
        batch_op.add_column(sa.Column("description", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("tags", sa.JSON(), nullable=False, server_default="[]"))
        batch_op.add_column(sa.Column("updated_at", _TIME, nullable=True))
        batch_op.add_column(sa.Column("deleted_at", _TIME, nullable=True))
        batch_op.drop_constraint(op.f("uq_model_packages_tenant_id_name"), type_="unique")
    with op.batch_alter_table("model_packages", schema=None) as batch_op:
        batch_op.alter_column("tags", server_default=None)
    op.create_index(
        "uq_model_packages_tenant_name_live",
        "model_packages",
        ["tenant_id", "name"],
        unique=True,
        sqlite_where=sa.text(_LIVE),
        postgresql_where=sa.text(_LIVE),
    )
    # A run saves into one live package: two first saves at once cannot make two.
    op.create_index(
        "uq_model_packages_training_run_live",
        "model_packages",
        ["training_run_id"],
        unique=True,
        sqlite_where=sa.text(_RUN_LIVE),
        postgresql_where=sa.text(_RUN_LIVE),
    )
    op.execute("UPDATE model_packages SET updated_at = created_at")

    with op.batch_alter_table("model_versions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("session_id", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("seq_id", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("tokens_trained", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("source_version_id", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("base_model", sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column("base_revision", sa.String(length=100), nullable=True))
        batch_op.add_column(sa.Column("created_by_key_id", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("files", sa.JSON(), nullable=True))
        batch_op.create_foreign_key(
            op.f("fk_model_versions_session_id_sessions"), "sessions", ["session_id"], ["id"]
        )
        batch_op.create_foreign_key(
            op.f("fk_model_versions_source_version_id_model_versions"),
            "model_versions",
            ["source_version_id"],
            ["id"],
        )
        batch_op.create_foreign_key(
            op.f("fk_model_versions_created_by_key_id_api_keys"),
            "api_keys",
            ["created_by_key_id"],
            ["id"],
        )
    op.execute(
        "UPDATE model_versions SET base_model = (SELECT model_packages.base_model FROM "
        "model_packages WHERE model_packages.id = model_versions.package_id)"
    )
    op.execute(
        "UPDATE model_versions SET session_id = (SELECT training_runs.session_id FROM "
        "training_runs WHERE training_runs.id = model_versions.training_run_id)"
    )
    op.execute("UPDATE model_versions SET kind = 'adapter' WHERE kind = 'external'")

    with op.batch_alter_table("training_runs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("tokens_trained", sa.BigInteger(), nullable=False, server_default="0")
        )
        batch_op.add_column(
            sa.Column("loaded_from_version_id", sa.String(length=64), nullable=True)
        )
        batch_op.create_foreign_key(
            op.f("fk_training_runs_loaded_from_version_id_model_versions"),
            "model_versions",
            ["loaded_from_version_id"],
            ["id"],
            use_alter=True,
        )
    with op.batch_alter_table("training_runs", schema=None) as batch_op:
        batch_op.alter_column("tokens_trained", server_default=None)

    op.add_column("operations", sa.Column("payload_pruned_at", _TIME, nullable=True))
    # Sessions the OpenAI-compatible API opens per API key (`serving`) are kept apart from
    # clients' own (`client`), which alone count against the concurrent-session quota.
    op.add_column(
        "sessions",
        sa.Column("kind", sa.String(length=16), nullable=False, server_default="client"),
    )
    op.create_index(
        "ix_operations_unpruned_finished_at",
        "operations",
        ["finished_at"],
        sqlite_where=sa.text(_UNPRUNED),
        postgresql_where=sa.text(_UNPRUNED),
    )


def downgrade() -> None:
    op.drop_column("sessions", "kind")
    op.drop_index("ix_operations_unpruned_finished_at", table_name="operations")
    op.drop_column("operations", "payload_pruned_at")
    with op.batch_alter_table("training_runs", schema=None) as batch_op:
        batch_op.drop_constraint(
            op.f("fk_training_runs_loaded_from_version_id_model_versions"), type_="foreignkey"
        )
        batch_op.drop_column("loaded_from_version_id")
        batch_op.drop_column("tokens_trained")
    op.execute("UPDATE model_versions SET kind = 'external' WHERE kind IN ('adapter', 'merged')")
    with op.batch_alter_table("model_versions", schema=None) as batch_op:
        batch_op.drop_constraint(
            op.f("fk_model_versions_created_by_key_id_api_keys"), type_="foreignkey"
        )
        batch_op.drop_constraint(
            op.f("fk_model_versions_source_version_id_model_versions"), type_="foreignkey"
        )
        batch_op.drop_constraint(op.f("fk_model_versions_session_id_sessions"), type_="foreignkey")
        for column in (
            "files",
            "created_by_key_id",
            "base_revision",
            "base_model",
            "source_version_id",
            "tokens_trained",
            "seq_id",
            "session_id",
        ):
            batch_op.drop_column(column)
    op.drop_index("uq_model_packages_training_run_live", table_name="model_packages")
    op.drop_index("uq_model_packages_tenant_name_live", table_name="model_packages")
    # Deleted packages' names may repeat live ones; the old constraint needs them unique.
    op.execute("UPDATE model_packages SET name = name || '#' || id WHERE deleted_at IS NOT NULL")
    with op.batch_alter_table("model_packages", schema=None) as batch_op:
        batch_op.create_unique_constraint(
            op.f("uq_model_packages_tenant_id_name"), ["tenant_id", "name"]
        )
        for column in ("deleted_at", "updated_at", "tags", "description"):
            batch_op.drop_column(column)
