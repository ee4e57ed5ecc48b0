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
    # An older release knows only live and dead. A draining worker still holds its runs under
    # its lease: live, so that the older beat declares it dead (and requeues what it ran) once
    # the lease lapses. One that left holds nothing: dead.
    op.execute("UPDATE workers SET status = 'live' WHERE status = 'draining'")
    op.execute("UPDATE workers SET status = 'dead' WHERE status = 'left'")
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_column("left_at")
