"""Wire types of the pre-flight cost estimate (a Treadle extension of the protocol)."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from treadle.types._base import WireRequest, WireResponse


class CostEstimateRequest(WireRequest):
    """What some work would cost on `base_model` at the prices in force now.

    `usage` maps usage kinds to quantities: `training`, `sampling_prefill` and
    `sampling_sample` in tokens, `checkpoint` in saves, `storage` in byte-hours (bytes held for
    one hour). `cached_prefill_tokens` of the `sampling_prefill` tokens are priced at the
    cached-prefill rate.
    """

    base_model: str = Field(min_length=1, max_length=200)
    usage: dict[str, int] = Field(max_length=16)
    cached_prefill_tokens: int = Field(default=0, ge=0)


class CostEstimateLine(WireResponse):
    kind: str
    quantity: int
    cached_quantity: int = 0
    price_id: int | None = None
    """The price version used; None when the kind has no price (it costs nothing)."""
    amount_micros: int
    """What the line costs, in micro-units of the currency (1e-6)."""
    amount: str
    """The same amount as an exact decimal string (e.g. "0.012500")."""


class CostEstimateResponse(WireResponse):
    base_model: str
    priced_at: datetime
    lines: list[CostEstimateLine]
    total_micros: int
    total: str
