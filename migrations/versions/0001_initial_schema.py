"""Initial schema: every table of the data model (docs/architecture.md).

Revision ID: 0001
Revises:
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "prices",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("base_model", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("micros_per_million", sa.BigInteger(), nullable=False),
        sa.Column("effective_from", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_prices")),
        sa.UniqueConstraint(
            "base_model",
            "kind",
            "effective_from",
            name=op.f("uq_prices_base_model_kind_effective_from"),
        ),
    )
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("max_concurrent_sessions", sa.Integer(), nullable=False),
        sa.Column("max_lora_rank", sa.Integer(), nullable=False),
        sa.Column("spend_limit_micros", sa.BigInteger(), nullable=True),
        sa.Column("stripe_customer_id", sa.String(length=100), nullable=True),
        sa.Column("disabled", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    op.create_table(
        "workers",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("hostname", sa.String(length=200), nullable=False),
        sa.Column("device", sa.String(length=32), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=True),
        sa.Column("models", sa.JSON(), nullable=False),
        sa.Column("capacity_runs", sa.Integer(), nullable=False),
        sa.Column("capacity_tokens", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("held_runs", sa.Integer(), nullable=False),
        sa.Column("adapter_bytes", sa.BigInteger(), nullable=False),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_api_keys_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
    )
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_api_keys_tenant_id"), ["tenant_id"], unique=False)

    op.create_table(
        "audit_log",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=True),
        sa.Column("actor", sa.String(length=64), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("target", sa.String(length=200), nullable=True),
        sa.Column("detail", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_audit_log_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_audit_log_tenant_id"), ["tenant_id"], unique=False)

    op.create_table(
        "usage_rollups",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
        sa.Column("base_model", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("quantity", sa.BigInteger(), nullable=False),
        sa.Column("amount_micros", sa.BigInteger(), nullable=False),
        sa.Column("reported_to_stripe", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_usage_rollups_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_rollups")),
        sa.UniqueConstraint(
            "tenant_id",
            "hour",
            "base_model",
            "kind",
            name=op.f("uq_usage_rollups_tenant_id_hour_base_model_kind"),
        ),
    )
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("api_key_id", sa.String(length=32), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=True),
        sa.Column("sdk_version", sa.String(length=64), nullable=True),
        sa.Column("project_id", sa.String(length=200), nullable=True),
        sa.Column("display_name", sa.String(length=200), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("end_reason", sa.String(length=32), nullable=True),
        sa.Column("end_detail", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["api_key_id"], ["api_keys.id"], name=op.f("fk_sessions_api_key_id_api_keys")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_sessions_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sessions")),
    )
    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.create_index("ix_sessions_tenant_status", ["tenant_id", "status"], unique=False)

    op.create_table(
        "operations",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("target_id", sa.String(length=128), nullable=False),
        sa.Column("seq_id", sa.BigInteger(), nullable=True),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.Column("payload_codec", sa.String(length=16), nullable=False),
        sa.Column("result", sa.LargeBinary(), nullable=True),
        sa.Column("result_codec", sa.String(length=32), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("error_category", sa.String(length=16), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.id"], name=op.f("fk_operations_session_id_sessions")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_operations_tenant_id_tenants")
        ),
        sa.ForeignKeyConstraint(
            ["worker_id"], ["workers.id"], name=op.f("fk_operations_worker_id_workers")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_operations")),
        sa.UniqueConstraint("target_id", "seq_id", name=op.f("uq_operations_target_id_seq_id")),
    )
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_operations_session_id"), ["session_id"], unique=False)
        batch_op.create_index("ix_operations_status_target", ["status", "target_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_operations_tenant_id"), ["tenant_id"], unique=False)

    op.create_table(
        "training_runs",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("model_seq_id", sa.Integer(), nullable=False),
        sa.Column("base_model", sa.String(length=200), nullable=False),
        sa.Column("lora_rank", sa.Integer(), nullable=False),
        sa.Column("lora_config", sa.JSON(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("corrupted", sa.Boolean(), nullable=False),
        sa.Column("worker_id", sa.String(length=64), nullable=True),
        sa.Column("executed_seq_id", sa.BigInteger(), nullable=False),
        sa.Column("snapshot_seq_id", sa.BigInteger(), nullable=True),
        sa.Column("snapshot_uri", sa.Text(), nullable=True),
        sa.Column("optim_steps", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_request_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.id"], name=op.f("fk_training_runs_session_id_sessions")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_training_runs_tenant_id_tenants")
        ),
        sa.ForeignKeyConstraint(
            ["worker_id"], ["workers.id"], name=op.f("fk_training_runs_worker_id_workers")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_training_runs")),
        sa.UniqueConstraint(
            "session_id", "model_seq_id", name=op.f("uq_training_runs_session_id_model_seq_id")
        ),
    )
    with op.batch_alter_table("training_runs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_training_runs_tenant_id"), ["tenant_id"], unique=False)

    op.create_table(
        "model_packages",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("base_model", sa.String(length=200), nullable=False),
        sa.Column("training_run_id", sa.String(length=128), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_model_packages_tenant_id_tenants")
        ),
        sa.ForeignKeyConstraint(
            ["training_run_id"],
            ["training_runs.id"],
            name=op.f("fk_model_packages_training_run_id_training_runs"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_packages")),
        sa.UniqueConstraint("tenant_id", "name", name=op.f("uq_model_packages_tenant_id_name")),
    )
    op.create_table(
        "usage_events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("session_id", sa.String(length=64), nullable=True),
        sa.Column("operation_id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("base_model", sa.String(length=200), nullable=False),
        sa.Column("quantity", sa.BigInteger(), nullable=False),
        sa.Column("cached_quantity", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["operation_id"],
            ["operations.id"],
            name=op.f("fk_usage_events_operation_id_operations"),
        ),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.id"], name=op.f("fk_usage_events_session_id_sessions")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_usage_events_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_events")),
        sa.UniqueConstraint("operation_id", "kind", name=op.f("uq_usage_events_operation_id_kind")),
    )
    with op.batch_alter_table("usage_events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_usage_events_tenant_id"), ["tenant_id"], unique=False)

    op.create_table(
        "model_versions",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("package_id", sa.String(length=64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("tinker_path", sa.String(length=512), nullable=True),
        sa.Column("training_run_id", sa.String(length=128), nullable=True),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("parent_version_id", sa.String(length=64), nullable=True),
        sa.Column("lora_config", sa.JSON(), nullable=True),
        sa.Column("user_metadata", sa.JSON(), nullable=True),
        sa.Column("artifact_uri", sa.Text(), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("sha256", sa.String(length=64), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("public", sa.Boolean(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["package_id"],
            ["model_packages.id"],
            name=op.f("fk_model_versions_package_id_model_packages"),
        ),
        sa.ForeignKeyConstraint(
            ["parent_version_id"],
            ["model_versions.id"],
            name=op.f("fk_model_versions_parent_version_id_model_versions"),
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_model_versions_tenant_id_tenants")
        ),
        sa.ForeignKeyConstraint(
            ["training_run_id"],
            ["training_runs.id"],
            name=op.f("fk_model_versions_training_run_id_training_runs"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_versions")),
        sa.UniqueConstraint(
            "package_id", "version", name=op.f("uq_model_versions_package_id_version")
        ),
        sa.UniqueConstraint("tinker_path", name=op.f("uq_model_versions_tinker_path")),
    )
    with op.batch_alter_table("model_versions", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_model_versions_tenant_id"), ["tenant_id"], unique=False
        )

    op.create_table(
        "model_aliases",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("package_id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("version_id", sa.String(length=64), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["package_id"],
            ["model_packages.id"],
            name=op.f("fk_model_aliases_package_id_model_packages"),
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_model_aliases_tenant_id_tenants")
        ),
        sa.ForeignKeyConstraint(
            ["version_id"],
            ["model_versions.id"],
            name=op.f("fk_model_aliases_version_id_model_versions"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_aliases")),
        sa.UniqueConstraint("package_id", "name", name=op.f("uq_model_aliases_package_id_name")),
    )
    with op.batch_alter_table("model_aliases", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_model_aliases_tenant_id"), ["tenant_id"], unique=False)

    op.create_table(
        "sampling_sessions",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("sampling_session_seq_id", sa.BigInteger(), nullable=False),
        sa.Column("base_model", sa.String(length=200), nullable=False),
        sa.Column("model_path", sa.Text(), nullable=True),
        sa.Column("training_run_id", sa.String(length=128), nullable=True),
        sa.Column("model_version_id", sa.String(length=64), nullable=True),
        sa.Column("worker_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_version_id"],
            ["model_versions.id"],
            name=op.f("fk_sampling_sessions_model_version_id_model_versions"),
        ),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.id"], name=op.f("fk_sampling_sessions_session_id_sessions")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_sampling_sessions_tenant_id_tenants")
        ),
        sa.ForeignKeyConstraint(
            ["training_run_id"],
            ["training_runs.id"],
            name=op.f("fk_sampling_sessions_training_run_id_training_runs"),
        ),
        sa.ForeignKeyConstraint(
            ["worker_id"], ["workers.id"], name=op.f("fk_sampling_sessions_worker_id_workers")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sampling_sessions")),
        sa.UniqueConstraint(
            "session_id",
            "sampling_session_seq_id",
            name=op.f("uq_sampling_sessions_session_id_sampling_session_seq_id"),
        ),
    )
    with op.batch_alter_table("sampling_sessions", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_sampling_sessions_tenant_id"), ["tenant_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("sampling_sessions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_sampling_sessions_tenant_id"))

    op.drop_table("sampling_sessions")
    with op.batch_alter_table("model_aliases", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_model_aliases_tenant_id"))

    op.drop_table("model_aliases")
    with op.batch_alter_table("model_versions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_model_versions_tenant_id"))

    op.drop_table("model_versions")
    with op.batch_alter_table("usage_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_usage_events_tenant_id"))

    op.drop_table("usage_events")
    op.drop_table("model_packages")
    with op.batch_alter_table("training_runs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_training_runs_tenant_id"))

    op.drop_table("training_runs")
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_operations_tenant_id"))
        batch_op.drop_index("ix_operations_status_target")
        batch_op.drop_index(batch_op.f("ix_operations_session_id"))

    op.drop_table("operations")
    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.drop_index("ix_sessions_tenant_status")

    op.drop_table("sessions")
    op.drop_table("usage_rollups")
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_audit_log_tenant_id"))

    op.drop_table("audit_log")
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_keys_tenant_id"))

    op.drop_table("api_keys")
    op.drop_table("workers")
    op.drop_table("tenants")
    op.drop_table("prices")
