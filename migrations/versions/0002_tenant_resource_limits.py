"""Per-tenant resource limits (NULL: the server's default), and the indexes that count usage.

Revision ID: 0002
Revises: 0001
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# Plain ALTER TABLE statements (not batch mode): SQLite 3.35+ adds and drops columns in place,
# whereas recreating `tenants` would trip over the foreign keys that point at it.


def upgrade() -> None:
    op.add_column("tenants", sa.Column("max_training_runs", sa.Integer(), nullable=True))
    op.add_column("tenants", sa.Column("max_lora_parameters", sa.BigInteger(), nullable=True))
    op.add_column("tenants", sa.Column("max_queued_ops", sa.Integer(), nullable=True))
    op.add_column("tenants", sa.Column("max_sampling_requests", sa.Integer(), nullable=True))
    op.create_index("ix_operations_tenant_status", "operations", ["tenant_id", "status"])
    op.create_index("ix_training_runs_tenant_status", "training_runs", ["tenant_id", "status"])


def downgrade() -> None:
    op.drop_index("ix_training_runs_tenant_status", table_name="training_runs")
    op.drop_index("ix_operations_tenant_status", table_name="operations")
    op.drop_column("tenants", "max_sampling_requests")
    op.drop_column("tenants", "max_queued_ops")
    op.drop_column("tenants", "max_lora_parameters")
    op.drop_column("tenants", "max_training_runs")
