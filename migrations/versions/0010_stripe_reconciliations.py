"""The reconciler's results, kept so the dashboard can show the latest; and indexes on the
Stripe push record for the dashboard's billing page (the latest hour Stripe accepted, and when
it last accepted one), which would otherwise scan every part ever pushed.

Revision ID: 0010
Revises: 0009
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_TIME = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "stripe_reconciliations",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("ran_at", _TIME, nullable=False),
        sa.Column("since", _TIME, nullable=False),
        sa.Column("until", _TIME, nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("compared", sa.Integer(), nullable=False),
        sa.Column("differences", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_stripe_reconciliations")),
    )
    op.create_index(op.f("ix_stripe_reconciliations_ran_at"), "stripe_reconciliations", ["ran_at"])
    op.create_index("ix_stripe_meter_pushes_hour", "stripe_meter_pushes", ["hour"])
    op.create_index("ix_stripe_meter_pushes_accepted_at", "stripe_meter_pushes", ["accepted_at"])


def downgrade() -> None:
    op.drop_index("ix_stripe_meter_pushes_accepted_at", table_name="stripe_meter_pushes")
    op.drop_index("ix_stripe_meter_pushes_hour", table_name="stripe_meter_pushes")
    op.drop_index(op.f("ix_stripe_reconciliations_ran_at"), table_name="stripe_reconciliations")
    op.drop_table("stripe_reconciliations")
