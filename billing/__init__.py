"""Metering: the usage ledger, which records quantities per operation and kind.

Billing proper is not built yet: there are no prices, hourly rollups, spend caps or Stripe
gateway. The `prices` and `usage_rollups` tables exist (`billing.tables`) but nothing reads or
writes them, and a tenant's spend limit is stored but not enforced.

Imports `core` only. `stripe` may be imported here and nowhere else (an import-linter contract).
"""
