"""Workers that drain: when a worker last handed its runs over and left.

The `draining` and `left` statuses need no schema change (`workers.status` is a string).

Revision ID: 0007
Revises: 0006
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("left_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    # An older release knows only live and dead: a worker that left is, to it, dead.
    op.execute("UPDATE workers SET status = 'dead' WHERE status IN ('draining', 'left')")
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_column("left_at")
