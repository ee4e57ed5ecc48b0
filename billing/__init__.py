"""Metering and billing: the usage ledger, prices, rollups, spend caps, the Stripe gateway.

Imports `core` only; the only module allowed to import `stripe` lives here.
"""
