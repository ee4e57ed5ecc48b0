"""Billing: usage turned into money, spend held to limits, and usage pushed to Stripe.

- `ledger`: the one write path for operations' usage events, each priced when recorded and
  added, in the same transaction, to its hourly rollup and the tenant's period spend.
- `prices` (reading: the version in force, an event's cost, the per-process `PriceCache`) and
  `pricebook` (writing versions, never edited, only ever effective a minute ahead; listing).
- `rollups`: hourly sums per tenant, API key, session, model, kind and price version; their
  reader and their rebuild from the ledger. `spend`: spend per billing period (a UTC month).
- `estimate` and `limits`: an op's cost before it runs, held against the tenant's and the
  session's spend limits at submission.
- `storage`: hourly checkpoint storage metering; `jobs`: the periodic jobs that run it and the
  Stripe push. `reports`: what a tenant reads of its usage and costs.
- `stripe_push`, `stripe_parts`, `stripe_reconcile`: priced usage sent to Stripe meters
  exactly once (each part recorded as intended before it is sent), and compared with Stripe's
  totals.

Imports `core` only. `stripe` is imported by `billing.stripe_gateway` alone (an import-linter
contract); `billing.stripe_push` and `billing.stripe_reconcile` reach Stripe through it.
Money is integer micro-units throughout (see docs/billing.md).
"""
