"""Wire types of Treadle's usage report (a Treadle extension of the protocol)."""

from __future__ import annotations

from datetime import datetime

from treadle.types._base import WireResponse


class UsageLine(WireResponse):
    base_model: str
    kind: str
    """`training`, `sampling_prefill` or `sampling_sample` tokens, or `checkpoint` saves."""
    quantity: int


class UsageReport(WireResponse):
    since: datetime | None = None
    until: datetime | None = None
    lines: list[UsageLine]
