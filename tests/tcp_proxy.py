"""A TCP proxy in front of one server that tests can stop and restart on the same port, to make
a database or Redis unreachable as a failed server or network would."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any

from tests.services import free_port


class TcpProxy:
    """Forwards `127.0.0.1:port` to `host:target_port`. `stop()` refuses new connections and
    cuts the open ones; `start()` listens on the same port again."""

    def __init__(self, host: str, target_port: int) -> None:
        self.target = (host, target_port)
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"tcp-proxy-{self.port}", daemon=True
        )
        self._thread.start()
        self.start()

    def start(self) -> None:
        self._call(self._start())

    def stop(self) -> None:
        self._call(self._stop())

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _call(self, work: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout=10)

    async def _start(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def _stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._open):
            writer.transport.abort()
        await self._server.wait_closed()
        self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._open.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            self._open.difference_update((writer, up_writer))
