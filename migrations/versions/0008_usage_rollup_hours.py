"""Usage rollups by hour: the admin dashboard reads a date range of every tenant's rollups,
which without this index is a scan of the whole table.

Revision ID: 0008
Revises: 0007
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_usage_rollups_hour", "usage_rollups", ["hour"])


def downgrade() -> None:
    op.drop_index("ix_usage_rollups_hour", table_name="usage_rollups")
