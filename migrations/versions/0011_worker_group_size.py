"""Worker groups: how many ranks (devices) each worker has, which placement compares with the
devices a model needs and divides a worker's load by.

Revision ID: 0011
Revises: 0010
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Every worker registered so far is one device.
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("group_size", sa.Integer(), server_default="1", nullable=False)
        )


def downgrade() -> None:
    # An older release places on any worker serving a model, as one device each.
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_column("group_size")
