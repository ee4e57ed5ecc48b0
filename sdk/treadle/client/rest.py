"""RestClient: list and manage training runs and checkpoints, and download checkpoint files.

These calls need no session. Checkpoints are addressed by their `tinker://` path throughout.
Every method has an `*_async` twin for asyncio code.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import httpx

from treadle._connection import Connection
from treadle.errors import APIConnectionError, error_from_response
from treadle.types import (
    CheckpointPath,
    CheckpointsListResponse,
    ExternalWeightsUrlsResponse,
    GetSessionResponse,
    ListSessionsResponse,
    ServerCapabilities,
    TrainingRun,
    TrainingRunsResponse,
    UsageReport,
    WeightsInfoResponse,
)

T = TypeVar("T")
ProgressFn = Callable[[str, int, int | None], None]
"""`(relative file path, bytes received so far, file size or None)`."""


class RestClient:
    """Runs, checkpoints and sessions of the caller's tenant.

    Create it with `ServiceClient.create_rest_client()`, or on its own with
    `RestClient(base_url=..., api_key=...)` (then close it, or use it as a context manager).
    """

    def __init__(
        self,
        connection: Connection | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
    ) -> None:
        if connection is None:
            from treadle.client.service import resolve_credentials

            url, key = resolve_credentials(base_url, api_key)
            connection = Connection(url, key)
            self._owns_connection = True
        else:
            self._owns_connection = False
        self._conn = connection

    def __enter__(self) -> RestClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Release the connection if this client opened it."""
        if self._owns_connection:
            self._conn.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._conn.run(coro)

    async def _get(self, path: str, model: type[T], **params: Any) -> T:
        response = await self._conn.http.request("GET", path, params=params or None)
        return model.model_validate(response.json())  # type: ignore[attr-defined]

    async def _send(self, method: str, path: str, json: Any = None) -> None:
        await self._conn.http.request(method, path, json=json)

    # -- server -----------------------------------------------------------------------------

    def get_server_capabilities(self) -> ServerCapabilities:
        """The base models the server offers."""
        return self._run(self.get_server_capabilities_async())

    async def get_server_capabilities_async(self) -> ServerCapabilities:
        return await self._conn.call(
            self._get("/api/v1/get_server_capabilities", ServerCapabilities)
        )

    # -- training runs ----------------------------------------------------------------------

    def list_training_runs(self, limit: int = 20, offset: int = 0) -> TrainingRunsResponse:
        """The caller's training runs, newest first (`cursor.total_count` counts them all)."""
        return self._run(self.list_training_runs_async(limit, offset))

    async def list_training_runs_async(
        self, limit: int = 20, offset: int = 0
    ) -> TrainingRunsResponse:
        return await self._conn.call(
            self._get("/api/v1/training_runs", TrainingRunsResponse, limit=limit, offset=offset)
        )

    def get_training_run(self, run_id: str) -> TrainingRun:
        """One training run. Raises NotFoundError for unknown or foreign ids."""
        return self._run(self.get_training_run_async(run_id))

    async def get_training_run_async(self, run_id: str) -> TrainingRun:
        return await self._conn.call(self._get(f"/api/v1/training_runs/{run_id}", TrainingRun))

    def get_training_run_by_tinker_path(self, path: str) -> TrainingRun:
        """The run a checkpoint belongs to. Raises ValueError for a malformed path."""
        return self.get_training_run(CheckpointPath.parse(path).training_run_id)

    # -- usage ------------------------------------------------------------------------------

    def get_usage(
        self, since: datetime | None = None, until: datetime | None = None
    ) -> UsageReport:
        """Tokens and saves billed to the caller's tenant, per base model and kind.

        Args:
            since, until: limit the report to [since, until) (aware datetimes).
        """
        return self._run(self.get_usage_async(since, until))

    async def get_usage_async(
        self, since: datetime | None = None, until: datetime | None = None
    ) -> UsageReport:
        params = {
            k: v.isoformat() for k, v in (("since", since), ("until", until)) if v is not None
        }
        return await self._conn.call(self._get("/api/v1/usage", UsageReport, **params))

    # -- checkpoints ------------------------------------------------------------------------

    def list_checkpoints(self, run_id: str) -> CheckpointsListResponse:
        """The live checkpoints of one run."""
        return self._run(self.list_checkpoints_async(run_id))

    async def list_checkpoints_async(self, run_id: str) -> CheckpointsListResponse:
        return await self._conn.call(
            self._get(f"/api/v1/training_runs/{run_id}/checkpoints", CheckpointsListResponse)
        )

    def list_user_checkpoints(self, limit: int = 100, offset: int = 0) -> CheckpointsListResponse:
        """The caller's live checkpoints across all runs, newest first."""
        return self._run(self.list_user_checkpoints_async(limit, offset))

    async def list_user_checkpoints_async(
        self, limit: int = 100, offset: int = 0
    ) -> CheckpointsListResponse:
        return await self._conn.call(
            self._get("/api/v1/checkpoints", CheckpointsListResponse, limit=limit, offset=offset)
        )

    def delete_checkpoint(self, path: str) -> None:
        """Delete a checkpoint and its files."""
        self._run(self.delete_checkpoint_async(path))

    async def delete_checkpoint_async(self, path: str) -> None:
        await self._conn.call(self._send("DELETE", _checkpoint_url(path)))

    def publish_checkpoint(self, path: str) -> None:
        """Make a checkpoint readable by other tenants (by its path)."""
        self._run(self.publish_checkpoint_async(path))

    async def publish_checkpoint_async(self, path: str) -> None:
        await self._conn.call(self._send("POST", _checkpoint_url(path) + "/publish"))

    def unpublish_checkpoint(self, path: str) -> None:
        """Make a published checkpoint private again."""
        self._run(self.unpublish_checkpoint_async(path))

    async def unpublish_checkpoint_async(self, path: str) -> None:
        await self._conn.call(self._send("DELETE", _checkpoint_url(path) + "/publish"))

    def set_checkpoint_ttl(self, path: str, ttl_seconds: int | None) -> None:
        """Expire the checkpoint `ttl_seconds` from now (1 h to 10 years); None keeps it."""
        self._run(self.set_checkpoint_ttl_async(path, ttl_seconds))

    async def set_checkpoint_ttl_async(self, path: str, ttl_seconds: int | None) -> None:
        await self._conn.call(
            self._send("PUT", _checkpoint_url(path) + "/ttl", {"ttl_seconds": ttl_seconds})
        )

    def get_weights_info(self, path: str) -> WeightsInfoResponse:
        """Base model and LoRA shape of a checkpoint."""
        return self._run(self.get_weights_info_async(path))

    async def get_weights_info_async(self, path: str) -> WeightsInfoResponse:
        async def fetch() -> WeightsInfoResponse:
            response = await self._conn.http.request(
                "POST", "/api/v1/weights_info", json={"tinker_path": path}
            )
            return WeightsInfoResponse.model_validate(response.json())

        return await self._conn.call(fetch())

    def get_external_weights_urls(self, path: str) -> ExternalWeightsUrlsResponse:
        """Signed, expiring download URLs for each file of a checkpoint."""
        return self._run(self.get_external_weights_urls_async(path))

    async def get_external_weights_urls_async(self, path: str) -> ExternalWeightsUrlsResponse:
        return await self._conn.call(
            self._get(_checkpoint_url(path) + "/external_weights_urls", ExternalWeightsUrlsResponse)
        )

    def download_checkpoint(
        self, path: str, destination: str | Path, on_progress: ProgressFn | None = None
    ) -> Path:
        """Download every file of a checkpoint into `destination` (created if missing).

        Args:
            on_progress: called as bytes arrive with (file, bytes so far, file size or None).

        Returns:
            The destination folder.

        Raises:
            NotFoundError: no such checkpoint, or its files are gone.
            APIConnectionError: a download failed midway.
        """
        return self._run(self._download(path, Path(destination), on_progress))

    async def download_checkpoint_async(
        self, path: str, destination: str | Path, on_progress: ProgressFn | None = None
    ) -> Path:
        return await self._conn.call(self._download(path, Path(destination), on_progress))

    async def _download(self, path: str, destination: Path, on_progress: ProgressFn | None) -> Path:
        urls = await self._get(
            _checkpoint_url(path) + "/external_weights_urls", ExternalWeightsUrlsResponse
        )
        root = destination.resolve()
        # The signed URL is the permission; never send the API key to wherever it points.
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as plain:
            for relpath, url in sorted(urls.urls.items()):
                target = (root / relpath).resolve()
                if not target.is_relative_to(root):
                    raise ValueError(f"refusing to write {relpath!r} outside {root}")
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    async with plain.stream("GET", url) as response:
                        if not response.is_success:
                            await response.aread()
                            raise error_from_response(response)
                        size = (
                            int(response.headers["content-length"])
                            if "content-length" in response.headers
                            else None
                        )
                        received = 0
                        with target.open("wb") as out:
                            async for block in response.aiter_bytes(1 << 20):
                                out.write(block)
                                received += len(block)
                                if on_progress is not None:
                                    on_progress(relpath, received, size)
                except httpx.TransportError as exc:
                    raise APIConnectionError(f"downloading {relpath} failed: {exc!r}") from exc
        return root

    # -- sessions ---------------------------------------------------------------------------

    def list_sessions(self, limit: int = 20, offset: int = 0) -> ListSessionsResponse:
        """Ids of the caller's sessions, newest first."""
        return self._run(self.list_sessions_async(limit, offset))

    async def list_sessions_async(self, limit: int = 20, offset: int = 0) -> ListSessionsResponse:
        return await self._conn.call(
            self._get("/api/v1/sessions", ListSessionsResponse, limit=limit, offset=offset)
        )

    def get_session(self, session_id: str) -> GetSessionResponse:
        """The training runs and samplers of one session."""
        return self._run(self.get_session_async(session_id))

    async def get_session_async(self, session_id: str) -> GetSessionResponse:
        return await self._conn.call(
            self._get(f"/api/v1/sessions/{session_id}", GetSessionResponse)
        )


def _checkpoint_url(path: str) -> str:
    parsed = CheckpointPath.parse(path)
    return f"/api/v1/training_runs/{parsed.training_run_id}/checkpoints/{parsed.checkpoint_id}"
