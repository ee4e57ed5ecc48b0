"""The server-side session behind a ServiceClient: creation, heartbeats, counters, finish.

The session is created on first need (so a ServiceClient used only for REST calls takes no
quota slot), then kept alive by a heartbeat every 10 s on the background loop. A 410 on a
heartbeat means the session has ended; later operations then fail with SessionExpiredError.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any, Literal

from treadle import __version__, _exit
from treadle._connection import Connection
from treadle._http import NO_RETRY
from treadle.errors import APIStatusError, SessionExpiredError, TreadleError
from treadle.types import CreateSessionResponse

logger = logging.getLogger("treadle")

HEARTBEAT_INTERVAL_SECONDS = 10.0
_HEARTBEAT_WARN_AFTER_SECONDS = 120.0

_FINISH_MAX_SECONDS = 30.0
"""Closing should not hang for minutes on a server that is gone: its TTL ends the session."""

FinishStatus = Literal["success", "errored", "interrupted"]


class Session:
    """One session's id, counters and heartbeat. Thread-safe."""

    def __init__(
        self,
        connection: Connection,
        *,
        tags: list[str] | None = None,
        user_metadata: dict[str, Any] | None = None,
        project_id: str | None = None,
        display_name: str | None = None,
        heartbeat_interval: float = HEARTBEAT_INTERVAL_SECONDS,
    ) -> None:
        self.connection = connection
        self._create_body: dict[str, Any] = {
            "tags": list(tags or []),
            "sdk_version": __version__,
            "type": "create_session",
        }
        for key, value in (
            ("user_metadata", user_metadata),
            ("project_id", project_id),
            ("display_name", display_name),
        ):
            if value is not None:
                self._create_body[key] = value
        self._heartbeat_interval = heartbeat_interval
        self._session_id: str | None = None
        self._create_lock: asyncio.Lock | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._counter_lock = threading.Lock()
        self._model_seq = 0
        self._sampling_seq = 0
        self.ended: str | None = None
        """Why the session ended (set by finish or a 410 heartbeat); None while open."""

    @property
    def session_id(self) -> str | None:
        return self._session_id

    async def ensure(self) -> str:
        """The session id, creating the session (and its heartbeat) on first call.

        Raises:
            SessionExpiredError: the session has ended.
            QuotaExceededError: the tenant's concurrent session limit is reached.
        """
        if self.ended is not None:
            raise SessionExpiredError(self.ended, status_code=410)
        if self._session_id is not None:
            return self._session_id
        if self._create_lock is None:
            self._create_lock = asyncio.Lock()
        async with self._create_lock:
            if self._session_id is None:
                await self.connection.config()
                response = await self.connection.http.request(
                    "POST", "/api/v1/create_session", json=self._create_body, idempotent=False
                )
                created = CreateSessionResponse.model_validate(response.json())
                for level, text in (
                    (logging.INFO, created.info_message),
                    (logging.WARNING, created.warning_message),
                    (logging.ERROR, created.error_message),
                ):
                    if text:
                        logger.log(level, "%s", text)
                self._session_id = created.session_id
                _exit.register(self)
                self._heartbeat = asyncio.get_running_loop().create_task(self._beat())
        return self._session_id

    def next_model_seq_id(self) -> int:
        with self._counter_lock:
            value = self._model_seq
            self._model_seq += 1
            return value

    def next_sampling_seq_id(self) -> int:
        with self._counter_lock:
            value = self._sampling_seq
            self._sampling_seq += 1
            return value

    async def _beat(self) -> None:
        failing_since: float | None = None
        while True:
            await asyncio.sleep(self._heartbeat_interval)
            try:
                await self.connection.http.request(
                    "POST",
                    "/api/v1/session_heartbeat",
                    json={"session_id": self._session_id, "type": "session_heartbeat"},
                    timeout=10.0,
                    retry=NO_RETRY,
                )
                failing_since = None
            except APIStatusError as exc:
                if exc.status_code in (404, 410):
                    self.ended = exc.message
                    logger.warning("session %s has ended: %s", self._session_id, exc.message)
                    return
                failing_since = self._note_failure(failing_since, exc)
            except TreadleError as exc:
                failing_since = self._note_failure(failing_since, exc)

    def _note_failure(self, since: float | None, exc: Exception) -> float:
        now = time.monotonic()
        since = now if since is None else since
        if now - since >= _HEARTBEAT_WARN_AFTER_SECONDS:
            logger.warning(
                "heartbeats of session %s have failed for %.0fs (%s); the server will end the "
                "session if this persists",
                self._session_id,
                now - since,
                exc,
            )
        return since

    async def finish(
        self,
        status: FinishStatus = "success",
        detail: str | None = None,
        *,
        max_seconds: float = _FINISH_MAX_SECONDS,
    ) -> None:
        """End the session on the server (first reason wins) and stop the heartbeat."""
        _exit.unregister(self)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None
        if self._session_id is None or self.ended is not None:
            self.ended = self.ended or "the session was finished by this client"
            return
        self.ended = f"session {self._session_id!r} was finished by this client"
        await self.connection.http.request(
            "POST",
            f"/api/v1/sessions/{self._session_id}/finish",
            json={"reason": {"type": status}, "detail": detail},
            retry=dataclasses.replace(
                self.connection.retry,
                max_elapsed_seconds=min(max_seconds, self.connection.retry.max_elapsed_seconds),
            ),
        )
