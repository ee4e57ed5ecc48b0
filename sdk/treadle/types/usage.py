"""Wire types of Treadle's usage report (a Treadle extension of the protocol)."""

from __future__ import annotations

from datetime import datetime

from treadle.types._base import WireResponse


def dollars(micros: int) -> str:
    """An amount of integer micro-units as an exact decimal string, e.g. 1234567 -> "1.234567"."""
    sign = "-" if micros < 0 else ""
    whole, fraction = divmod(abs(micros), 1_000_000)
    return f"{sign}{whole}.{fraction:06d}"


class UsageLine(WireResponse):
    base_model: str
    kind: str
    """`training`, `sampling_prefill` or `sampling_sample` tokens, `checkpoint` saves, or
    `storage` byte-hours."""
    quantity: int
    amount_micros: int = 0
    """What the line cost, in micro-units of the currency (1e-6)."""
    amount: str = "0.000000"
    """The same amount as an exact decimal string (e.g. "0.012500")."""


class UsageReport(WireResponse):
    since: datetime | None = None
    until: datetime | None = None
    lines: list[UsageLine]
    total_micros: int = 0
    """The sum of the lines' amounts."""
    total: str = "0.000000"
