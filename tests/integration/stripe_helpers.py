"""Helpers of the Stripe tests: tenants linked to Stripe customers, and priced usage written
straight into the ledger (its rows as the pricing ledger writes them)."""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta

from sqlalchemy import func, select

from billing.stripe_push import settled_before
from billing.tables import Price, UsageEvent
from core import tenants
from tests.scheduling import MODEL, Rows, migrated

_DEFAULT = -1


def hour_of(value: datetime) -> datetime:
    return value.replace(minute=0, second=0, microsecond=0)


class Ledger:
    """A migrated database at a fake time, with one price to charge usage under."""

    def __init__(self, database_url: str) -> None:
        self.rows = Rows(migrated(database_url))
        self.database = self.rows.database
        self.clock = self.rows.clock
        self.customers: dict[str, str] = {}
        self._versions = itertools.count()
        self.price = self.new_price()

    def tenant(self, stripe_customer_id: str | None) -> str:
        tenant_id = self.rows.tenant()
        if stripe_customer_id is not None:
            with self.database.transaction() as db:
                tenant = tenants.find_tenant(db, tenant_id)
                tenants.link_stripe_customer(
                    db, self.clock, tenant, stripe_customer_id, actor="operator"
                )
            self.customers[tenant_id] = stripe_customer_id
        return tenant_id

    def new_price(self) -> int:
        """A new price version's id (its rate does not matter: amounts are given)."""
        with self.database.transaction() as db:
            price = Price(
                base_model=MODEL,
                kind="training",
                unit_micros=1_000_000,
                cached_unit_micros=None,
                effective_from=datetime(2020, 1, 1).replace(tzinfo=self.clock.now().tzinfo)
                + timedelta(days=next(self._versions)),
                created_at=self.clock.now(),
                created_by="operator",
            )
            db.add(price)
            db.flush()
            return price.id

    def usage(
        self,
        tenant_id: str,
        kind: str,
        hour: datetime,
        amount_micros: int,
        *,
        price: int | None = _DEFAULT,
    ) -> None:
        """One usage event of `kind` in `hour` costing `amount_micros`, recorded now."""
        with self.database.transaction() as db:
            db.add(
                UsageEvent(
                    tenant_id=tenant_id,
                    kind=kind,
                    base_model=MODEL,
                    quantity=1,
                    cached_quantity=0,
                    price_id=self.price if price == _DEFAULT else price,
                    amount_micros=amount_micros,
                    hour=hour,
                    created_at=self.clock.now(),
                )
            )

    def settled_sum(self, tenant_id: str, kind: str) -> int:
        """The priced amount of the tenant's settled hours of `kind` (10 minutes' delay)."""
        with self.database.reader() as db:
            total = db.scalar(
                select(func.sum(UsageEvent.amount_micros)).where(
                    UsageEvent.tenant_id == tenant_id,
                    UsageEvent.kind == kind,
                    UsageEvent.price_id.is_not(None),
                    UsageEvent.hour < settled_before(self.clock.now(), 600),
                )
            )
            return int(total or 0)
