"""Daily usage per tenant, API key, base model and kind: the hourly rollups summed over
sessions and price versions, so the admin dashboard reads a day range of every tenant without
summing a row per hour, session and price. Filled from the hourly rollups already recorded.
The hourly rollups' index by hour also holds the dashboard's groupings and sums, so an hour
range is read from the index alone.

Revision ID: 0009
Revises: 0008
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_TIME = sa.DateTime(timezone=True)

# The UTC day of a rollup's hour. PostgreSQL: truncated in UTC, since date_trunc on a
# timestamptz works in the session's time zone. SQLite holds UTC times as text
# ("YYYY-MM-DD HH:MM:SS.ffffff"): zero what follows the date.
_DAY = {
    "postgresql": "date_trunc('day', hour AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'",
    "sqlite": "substr(hour, 1, 10) || ' 00:00:00.000000'",
}


def upgrade() -> None:
    op.create_table(
        "usage_daily",
        sa.Column("id", _ID, nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("day", _TIME, nullable=False),
        sa.Column("api_key_id", sa.String(length=32), nullable=False),
        sa.Column("base_model", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("events", sa.BigInteger(), nullable=False),
        sa.Column("quantity", sa.BigInteger(), nullable=False),
        sa.Column("cached_quantity", sa.BigInteger(), nullable=False),
        sa.Column("amount_micros", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_usage_daily_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_daily")),
        sa.UniqueConstraint(
            "day",
            "tenant_id",
            "api_key_id",
            "base_model",
            "kind",
            name=op.f("uq_usage_daily_day_tenant_id_api_key_id_base_model_kind"),
        ),
    )
    op.drop_index("ix_usage_rollups_hour", table_name="usage_rollups")
    op.create_index(
        "ix_usage_rollups_hour_sums",
        "usage_rollups",
        ["hour", "tenant_id", "api_key_id", "base_model", "kind", "quantity", "amount_micros"],
    )
    day = _DAY[op.get_bind().dialect.name]
    op.execute(
        "INSERT INTO usage_daily (tenant_id, day, api_key_id, base_model, kind, events, "
        "quantity, cached_quantity, amount_micros) "
        f"SELECT tenant_id, {day}, api_key_id, base_model, kind, sum(events), sum(quantity), "
        "sum(cached_quantity), sum(amount_micros) FROM usage_rollups "
        f"GROUP BY tenant_id, {day}, api_key_id, base_model, kind"
    )


def downgrade() -> None:
    op.drop_table("usage_daily")
    op.drop_index("ix_usage_rollups_hour_sums", table_name="usage_rollups")
    op.create_index("ix_usage_rollups_hour", "usage_rollups", ["hour"])
