"""Clients that also answer the methods of a future of themselves.

tinker's `ServiceClient.create_*` methods return a future of the new client (call `.result()`
or `await` it). Treadle's return the client itself, ready; giving the clients the future's
methods lets code written either way run unchanged.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Self


class ResolvedClient:
    """Mixin: `.result()`, `await`, `.done()` on a client return the client itself."""

    def result(self, timeout: float | None = None) -> Self:
        """This client (it is ready; tinker code calls `.result()` on a future of it)."""
        return self

    async def result_async(self, timeout: float | None = None) -> Self:
        """This client (see `result`)."""
        return self

    def done(self) -> bool:
        """Always True: the client is ready."""
        return True

    def __await__(self) -> Generator[Any, None, Self]:
        return self.result_async().__await__()
