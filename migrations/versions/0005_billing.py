"""Billing: a versioned price book, priced usage events, hourly rollups, spend counters and
the record of meter events meant for Stripe (each intended before it is sent).

`prices` and `usage_rollups` were created by 0001 but never used, so they are recreated in
their new shape. Existing usage events keep their quantities, get the hour they were recorded
in, and stay unpriced (`price_id` NULL, amount 0): no price book existed when they happened.

The price book starts with default "*" versions, in force from the epoch for every model
without its own: Tinker's published per-1M-token prices for Qwen3-4B-Instruct (January 2026:
$0.07 prefill, $0.22 sample, $0.22 train), cached prefill 80% off (October 2026), checkpoint
storage $0.10 per GB-month, and no per-checkpoint fee.

Revision ID: 0005
Revises: 0004
"""

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_TIME = sa.DateTime(timezone=True)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# (kind, micro-units per unit, cached micro-units): tokens per 1M, storage per GB-month,
# checkpoint per checkpoint.
_DEFAULT_PRICES = (
    ("training", 220_000, None),
    ("sampling_prefill", 70_000, 14_000),
    ("sampling_sample", 220_000, None),
    ("checkpoint", 0, None),
    ("storage", 100_000, None),
)


def upgrade() -> None:
    op.drop_table("prices")
    prices = op.create_table(
        "prices",
        sa.Column("id", _ID, nullable=False),
        sa.Column("base_model", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("unit_micros", sa.BigInteger(), nullable=False),
        sa.Column("cached_unit_micros", sa.BigInteger(), nullable=True),
        sa.Column("effective_from", _TIME, nullable=False),
        sa.Column("created_at", _TIME, nullable=False),
        sa.Column("created_by", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_prices")),
        sa.UniqueConstraint(
            "base_model",
            "kind",
            "effective_from",
            name=op.f("uq_prices_base_model_kind_effective_from"),
        ),
    )
    _seed_default_prices(prices)
    op.drop_table("usage_rollups")
    op.create_table(
        "usage_rollups",
        sa.Column("id", _ID, nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("hour", _TIME, nullable=False),
        sa.Column("api_key_id", sa.String(length=32), nullable=False),
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("base_model", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("price_id", sa.BigInteger(), nullable=False),
        sa.Column("events", sa.BigInteger(), nullable=False),
        sa.Column("quantity", sa.BigInteger(), nullable=False),
        sa.Column("cached_quantity", sa.BigInteger(), nullable=False),
        sa.Column("amount_micros", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_usage_rollups_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_rollups")),
        sa.UniqueConstraint(
            "tenant_id",
            "hour",
            "api_key_id",
            "session_id",
            "base_model",
            "kind",
            "price_id",
            name=op.f(
                "uq_usage_rollups_tenant_id_hour_api_key_id_session_id_base_model_kind_price_id"
            ),
        ),
    )
    op.create_index("ix_usage_rollups_session_id", "usage_rollups", ["session_id"])
    op.create_table(
        "tenant_spend",
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("period_start", _TIME, nullable=False),
        sa.Column("spent_micros", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_tenant_spend_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("tenant_id", "period_start", name=op.f("pk_tenant_spend")),
    )
    op.create_table(
        "stripe_meter_pushes",
        sa.Column("identifier", sa.String(length=200), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("stripe_customer_id", sa.String(length=100), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("hour", _TIME, nullable=False),
        sa.Column("price_id", sa.BigInteger(), nullable=False),
        sa.Column("part", sa.Integer(), nullable=False),
        sa.Column("value_micros", sa.BigInteger(), nullable=False),
        sa.Column("intended_at", _TIME, nullable=False),
        sa.Column("accepted_at", _TIME, nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_stripe_meter_pushes_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("identifier", name=op.f("pk_stripe_meter_pushes")),
        sa.UniqueConstraint(
            "tenant_id",
            "kind",
            "hour",
            "price_id",
            "part",
            name=op.f("uq_stripe_meter_pushes_tenant_id_kind_hour_price_id_part"),
        ),
    )
    op.create_index(
        "ix_stripe_meter_pushes_unaccepted",
        "stripe_meter_pushes",
        ["intended_at"],
        sqlite_where=sa.text("accepted_at IS NULL"),
        postgresql_where=sa.text("accepted_at IS NULL"),
    )

    with op.batch_alter_table("usage_events", schema=None) as batch_op:
        batch_op.alter_column("operation_id", existing_type=sa.String(length=64), nullable=True)
        batch_op.add_column(sa.Column("api_key_id", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("price_id", sa.BigInteger(), nullable=True))
        batch_op.add_column(
            sa.Column("amount_micros", sa.BigInteger(), nullable=False, server_default="0")
        )
        batch_op.add_column(sa.Column("hour", _TIME, nullable=True))
        batch_op.create_foreign_key(
            op.f("fk_usage_events_api_key_id_api_keys"), "api_keys", ["api_key_id"], ["id"]
        )
        batch_op.create_foreign_key(
            op.f("fk_usage_events_price_id_prices"), "prices", ["price_id"], ["id"]
        )
    _backfill_hours()
    with op.batch_alter_table("usage_events", schema=None) as batch_op:
        batch_op.alter_column("hour", existing_type=_TIME, nullable=False)
        batch_op.alter_column("amount_micros", server_default=None)
    op.create_index(
        "uq_usage_events_storage_hour",
        "usage_events",
        ["tenant_id", "hour"],
        unique=True,
        sqlite_where=sa.text("kind = 'storage'"),
        postgresql_where=sa.text("kind = 'storage'"),
    )

    op.add_column(
        "tenants", sa.Column("session_spend_limit_micros", sa.BigInteger(), nullable=True)
    )
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("api_key_id", sa.String(length=32), nullable=True))
        batch_op.add_column(
            sa.Column("reserved_micros", sa.BigInteger(), nullable=False, server_default="0")
        )
        batch_op.create_foreign_key(
            op.f("fk_operations_api_key_id_api_keys"), "api_keys", ["api_key_id"], ["id"]
        )
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.alter_column("reserved_micros", server_default=None)


def _seed_default_prices(prices: sa.Table | None) -> None:
    assert prices is not None
    op.bulk_insert(
        prices,
        [
            {
                "base_model": "*",
                "kind": kind,
                "unit_micros": unit,
                "cached_unit_micros": cached,
                "effective_from": _EPOCH,
                "created_at": _EPOCH,
                "created_by": "default",
            }
            for kind, unit, cached in _DEFAULT_PRICES
        ],
    )


def _backfill_hours() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        # Truncated in UTC: date_trunc on a timestamptz works in the session's time zone, and
        # a zone offset by half an hour would shift every hour.
        op.execute(
            "UPDATE usage_events SET hour = "
            "date_trunc('hour', created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'"
        )
        return
    # SQLite holds UTC times as text ("YYYY-MM-DD HH:MM:SS.ffffff"): zero what follows the hour.
    events = sa.table(
        "usage_events", sa.column("id", sa.Integer()), sa.column("created_at", sa.String())
    )
    for event_id, created in bind.execute(sa.select(events.c.id, events.c.created_at)).all():
        hour = created[:13] + ":00:00.000000"
        bind.execute(
            sa.text("UPDATE usage_events SET hour = :hour WHERE id = :id"),
            {"hour": hour, "id": event_id},
        )


def downgrade() -> None:
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.drop_constraint(op.f("fk_operations_api_key_id_api_keys"), type_="foreignkey")
        batch_op.drop_column("reserved_micros")
        batch_op.drop_column("api_key_id")
    op.drop_column("tenants", "session_spend_limit_micros")
    op.drop_index("uq_usage_events_storage_hour", table_name="usage_events")
    op.execute("DELETE FROM usage_events WHERE operation_id IS NULL")
    with op.batch_alter_table("usage_events", schema=None) as batch_op:
        batch_op.drop_constraint(op.f("fk_usage_events_price_id_prices"), type_="foreignkey")
        batch_op.drop_constraint(op.f("fk_usage_events_api_key_id_api_keys"), type_="foreignkey")
        batch_op.drop_column("hour")
        batch_op.drop_column("amount_micros")
        batch_op.drop_column("price_id")
        batch_op.drop_column("api_key_id")
        batch_op.alter_column("operation_id", existing_type=sa.String(length=64), nullable=False)
    op.drop_index("ix_stripe_meter_pushes_unaccepted", table_name="stripe_meter_pushes")
    op.drop_table("stripe_meter_pushes")
    op.drop_table("tenant_spend")
    op.drop_index("ix_usage_rollups_session_id", table_name="usage_rollups")
    op.drop_table("usage_rollups")
    op.create_table(
        "usage_rollups",
        sa.Column("id", _ID, nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("hour", _TIME, nullable=False),
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
    op.drop_table("prices")
    op.create_table(
        "prices",
        sa.Column("id", _ID, nullable=False),
        sa.Column("base_model", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("micros_per_million", sa.BigInteger(), nullable=False),
        sa.Column("effective_from", _TIME, nullable=False),
        sa.Column("created_at", _TIME, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_prices")),
        sa.UniqueConstraint(
            "base_model",
            "kind",
            "effective_from",
            name=op.f("uq_prices_base_model_kind_effective_from"),
        ),
    )
