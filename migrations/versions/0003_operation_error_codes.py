"""A failed operation's machine-readable error code (an `ErrorCode` value), beside its message.

Operations that failed before this revision keep NULL: readers derive their code from the
category (`scheduler.failures.OpFailure.stored`).

Revision ID: 0003
Revises: 0002
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# A plain ALTER TABLE (not batch mode), as in 0002: SQLite 3.35+ adds and drops columns in place.


def upgrade() -> None:
    op.add_column("operations", sa.Column("error_code", sa.String(32), nullable=True))


def downgrade() -> None:
    op.drop_column("operations", "error_code")
