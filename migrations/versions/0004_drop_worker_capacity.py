"""Workers no longer carry capacity columns that nothing read.

`capacity_runs` and `capacity_tokens` held fixed placeholders written at registration, and
`memory_bytes` was never written; placement goes by the models a worker serves and the runs
it already holds, so none of them informed a decision.

Revision ID: 0004
Revises: 0003
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# Plain ALTER TABLE statements (not batch mode), as in 0002: SQLite 3.35+ adds and drops
# columns in place.


def upgrade() -> None:
    op.drop_column("workers", "capacity_tokens")
    op.drop_column("workers", "capacity_runs")
    op.drop_column("workers", "memory_bytes")


def downgrade() -> None:
    # Existing rows get the placeholders the registering worker used to write.
    op.add_column("workers", sa.Column("memory_bytes", sa.BigInteger(), nullable=True))
    op.add_column(
        "workers",
        sa.Column("capacity_runs", sa.Integer(), nullable=False, server_default="10000"),
    )
    op.add_column(
        "workers",
        sa.Column("capacity_tokens", sa.BigInteger(), nullable=False, server_default=str(1 << 30)),
    )
