"""A connection to one server: the background loop, the HTTP client and the server's flags.

A ServiceClient owns one Connection and closes it. An unpickled SamplingClient in another
process shares a process-wide Connection per (base URL, API key) instead, which lives as long
as the process.
"""

from __future__ import annotations

import threading
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

import httpx

from treadle import __version__
from treadle._http import (
    DEFAULT_TIMEOUT_SECONDS,
    HttpClient,
    RetryPolicy,
    first_contact_seconds,
)
from treadle._loop import BackgroundLoop
from treadle.types import ClientConfigResponse

T = TypeVar("T")

DEFAULT_MAX_CHUNK_LEN = 1024
DEFAULT_MAX_CHUNK_BYTES = 5_000_000


class Connection:
    """Everything needed to talk to one server with one API key.

    `connect_timeout` bounds the wait for the server's first answer (None:
    `$TREADLE_CONNECT_TIMEOUT`, else 10 s); `url_source` says where the URL came from, for the
    error raised when the server cannot be reached.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        retry: RetryPolicy | None = None,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        transport: httpx.AsyncBaseTransport | None = None,
        headers: Mapping[str, str] | None = None,
        connect_timeout: float | None = None,
        url_source: str = "base_url=",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.retry = retry or RetryPolicy()
        self.loop = BackgroundLoop()
        self.http = HttpClient(
            self.base_url,
            api_key,
            retry=self.retry,
            timeout=timeout,
            transport=transport,
            headers=headers,
            first_contact_seconds=first_contact_seconds(connect_timeout),
            url_source=url_source,
        )
        self._config: ClientConfigResponse | None = None
        self.closed = False

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the background loop and wait for it."""
        return self.loop.run(coro, timeout)

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` on the background loop from the caller's event loop."""
        return await self.loop.call(coro)

    async def config(self) -> ClientConfigResponse:
        """The server's client flags (`/client/config`), fetched once."""
        if self._config is None:
            response = await self.http.request(
                "POST", "/api/v1/client/config", json={"sdk_version": __version__}
            )
            self._config = ClientConfigResponse.model_validate(response.json())
        return self._config

    async def chunk_limits(self) -> tuple[int, int]:
        """(datums, estimated bytes) allowed per forward_backward request."""
        config = await self.config()
        return (
            config.fwdbwd_max_chunk_len or DEFAULT_MAX_CHUNK_LEN,
            config.fwdbwd_max_chunk_bytes_count or DEFAULT_MAX_CHUNK_BYTES,
        )

    def close(self) -> None:
        """Close the HTTP client and stop the loop; idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self.loop.run(self.http.aclose(), timeout=10)
        finally:
            self.loop.close()


_shared: dict[tuple[str, str], Connection] = {}
_shared_lock = threading.Lock()


def shared_connection(base_url: str, api_key: str) -> Connection:
    """The process-wide connection for (base_url, api_key), created on first use."""
    key = (base_url.rstrip("/"), api_key)
    with _shared_lock:
        connection = _shared.get(key)
        if connection is None or connection.closed:
            connection = Connection(base_url, api_key, url_source="the unpickled client's base_url")
            _shared[key] = connection
        return connection
