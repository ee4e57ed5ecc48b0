"""RestClient: list and manage training runs and checkpoints, and download checkpoint files.

These calls need no session. Checkpoints are addressed by their `tinker://` path throughout;
`get_weights_info` also takes a registry reference (`package@alias`, `package:version`).
As in tinker's SDK, every method returns an `APIFuture` at once (`.result()` waits for the
answer, `await` works too), and has an `*_async` twin that returns the value itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar
from urllib.parse import quote, unquote, urlsplit

import httpx

from treadle._connection import Connection
from treadle.client import downloads
from treadle.client.downloads import ProgressFn
from treadle.futures import APIFuture
from treadle.types import (
    CheckpointPath,
    CheckpointsListResponse,
    CostEstimateRequest,
    CostEstimateResponse,
    CreatePackageRequest,
    DownloadUrlsResponse,
    ExternalWeightsUrlsResponse,
    FinishSessionResponse,
    LineageResponse,
    ListSessionsResponse,
    PromoteVersionRequest,
    RegistryAlias,
    RegistryAliasesResponse,
    RegistryPackage,
    RegistryPackagesResponse,
    RegistryVersion,
    RegistryVersionsResponse,
    ServerCapabilities,
    SessionInfo,
    SetAliasRequest,
    TrainingRun,
    TrainingRunsResponse,
    UpdatePackageRequest,
    UsageReport,
    WeightsInfoResponse,
)

T = TypeVar("T")
AccessScope = Literal["owned", "accessible"]


class RestClient:
    """Runs, checkpoints and sessions of the caller's tenant.

    Create it with `ServiceClient.create_rest_client()`, or on its own with
    `RestClient(base_url=..., api_key=...)` (then close it, or use it as a context manager).
    On its own, `base_url`, `api_key` and `connect_timeout` default as for `ServiceClient`.
    """

    def __init__(
        self,
        connection: Connection | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        connect_timeout: float | None = None,
    ) -> None:
        if connection is None:
            from treadle.client.service import resolve_base_url, resolve_credentials

            url, key = resolve_credentials(base_url, api_key)
            connection = Connection(
                url,
                key,
                connect_timeout=connect_timeout,
                url_source=resolve_base_url(base_url)[1],
            )
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

    def _future(self, coro: Coroutine[Any, Any, T]) -> APIFuture[T]:
        return APIFuture(self._conn.loop.spawn(coro))

    async def _get(self, path: str, model: type[T], **params: Any) -> T:
        response = await self._conn.http.request("GET", path, params=params or None)
        return model.model_validate(response.json())  # type: ignore[attr-defined]

    async def _send(self, method: str, path: str, json: Any = None) -> None:
        await self._conn.http.request(method, path, json=json)

    # -- server -----------------------------------------------------------------------------

    def get_server_capabilities(self) -> APIFuture[ServerCapabilities]:
        """The base models the server offers."""
        return self._future(self.get_server_capabilities_async())

    async def get_server_capabilities_async(self) -> ServerCapabilities:
        return await self._conn.call(
            self._get("/api/v1/get_server_capabilities", ServerCapabilities)
        )

    # -- training runs ----------------------------------------------------------------------

    def list_training_runs(
        self, limit: int = 20, offset: int = 0
    ) -> APIFuture[TrainingRunsResponse]:
        """The caller's training runs, newest first (`cursor.total_count` counts them all)."""
        return self._future(self.list_training_runs_async(limit, offset))

    async def list_training_runs_async(
        self, limit: int = 20, offset: int = 0
    ) -> TrainingRunsResponse:
        return await self._conn.call(
            self._get("/api/v1/training_runs", TrainingRunsResponse, limit=limit, offset=offset)
        )

    def get_training_run(
        self, training_run_id: str, access_scope: AccessScope = "owned"
    ) -> APIFuture[TrainingRun]:
        """One training run.

        Args:
            training_run_id: the run's id (its training client's `model_id`).
            access_scope: `owned` (yours only) or `accessible` (also another tenant's run that
                has a published checkpoint).

        Raises:
            NotFoundError: through the future, for an unknown id or one not in scope.
        """
        return self._future(self.get_training_run_async(training_run_id, access_scope))

    async def get_training_run_async(
        self, training_run_id: str, access_scope: AccessScope = "owned"
    ) -> TrainingRun:
        return await self._conn.call(
            self._get(
                f"/api/v1/training_runs/{training_run_id}", TrainingRun, access_scope=access_scope
            )
        )

    def get_training_run_by_tinker_path(
        self, tinker_path: str, access_scope: AccessScope = "owned"
    ) -> APIFuture[TrainingRun]:
        """The run a checkpoint belongs to (`access_scope` as for `get_training_run`).

        Raises:
            InvalidArgumentError: at once, for a malformed path.
        """
        run_id = CheckpointPath.parse(tinker_path).training_run_id
        return self.get_training_run(run_id, access_scope)

    async def get_training_run_by_tinker_path_async(
        self, tinker_path: str, access_scope: AccessScope = "owned"
    ) -> TrainingRun:
        run_id = CheckpointPath.parse(tinker_path).training_run_id
        return await self.get_training_run_async(run_id, access_scope)

    # -- usage ------------------------------------------------------------------------------

    def get_usage(
        self, since: datetime | None = None, until: datetime | None = None
    ) -> APIFuture[UsageReport]:
        """Tokens and saves billed to the caller's tenant, per base model and kind.

        Args:
            since, until: limit the report to [since, until) (aware datetimes).
        """
        return self._future(self.get_usage_async(since, until))

    async def get_usage_async(
        self, since: datetime | None = None, until: datetime | None = None
    ) -> UsageReport:
        params = {
            k: v.isoformat() for k, v in (("since", since), ("until", until)) if v is not None
        }
        return await self._conn.call(self._get("/api/v1/usage", UsageReport, **params))

    def estimate_cost(
        self, base_model: str, usage: dict[str, int], cached_prefill_tokens: int = 0
    ) -> APIFuture[CostEstimateResponse]:
        """What some work would cost at the prices in force now, per usage kind and in total.

        Args:
            base_model: the base model the work runs on.
            usage: quantities by usage kind: `training`, `sampling_prefill` and
                `sampling_sample` tokens, `checkpoint` saves, `storage` byte-hours.
            cached_prefill_tokens: how many of the `sampling_prefill` tokens hit the prefix
                cache (priced at the cached rate).

        Raises:
            BadRequestError: an unknown kind or base model, or a negative quantity.
        """
        return self._future(self.estimate_cost_async(base_model, usage, cached_prefill_tokens))

    async def estimate_cost_async(
        self, base_model: str, usage: dict[str, int], cached_prefill_tokens: int = 0
    ) -> CostEstimateResponse:
        request = CostEstimateRequest(
            base_model=base_model, usage=usage, cached_prefill_tokens=cached_prefill_tokens
        )

        async def post() -> CostEstimateResponse:
            response = await self._conn.http.request(
                "POST", "/api/v1/billing/estimate", json=request.model_dump(mode="json")
            )
            return CostEstimateResponse.model_validate(response.json())

        return await self._conn.call(post())

    # -- checkpoints ------------------------------------------------------------------------

    def list_checkpoints(self, training_run_id: str) -> APIFuture[CheckpointsListResponse]:
        """The live checkpoints of one run."""
        return self._future(self.list_checkpoints_async(training_run_id))

    async def list_checkpoints_async(self, training_run_id: str) -> CheckpointsListResponse:
        return await self._conn.call(
            self._get(
                f"/api/v1/training_runs/{training_run_id}/checkpoints", CheckpointsListResponse
            )
        )

    def list_user_checkpoints(
        self, limit: int = 100, offset: int = 0
    ) -> APIFuture[CheckpointsListResponse]:
        """The caller's live checkpoints across all runs, newest first."""
        return self._future(self.list_user_checkpoints_async(limit, offset))

    async def list_user_checkpoints_async(
        self, limit: int = 100, offset: int = 0
    ) -> CheckpointsListResponse:
        return await self._conn.call(
            self._get("/api/v1/checkpoints", CheckpointsListResponse, limit=limit, offset=offset)
        )

    def delete_checkpoint(self, path: str, checkpoint_id: str | None = None) -> APIFuture[None]:
        """Delete a checkpoint and its files.

        Args:
            path: the checkpoint's `tinker://` path; or, with `checkpoint_id`, its run's id
                (tinker's `delete_checkpoint(training_run_id, checkpoint_id)` form).
            checkpoint_id: e.g. `weights/step-20`, when `path` is a run id.
        """
        return self._future(self.delete_checkpoint_async(path, checkpoint_id))

    async def delete_checkpoint_async(self, path: str, checkpoint_id: str | None = None) -> None:
        if checkpoint_id is not None:
            path = f"tinker://{path}/{checkpoint_id}"
        await self._conn.call(self._send("DELETE", _checkpoint_url(path)))

    def publish_checkpoint(self, path: str) -> APIFuture[None]:
        """Make a checkpoint readable by other tenants (by its path)."""
        return self._future(self.publish_checkpoint_async(path))

    async def publish_checkpoint_async(self, path: str) -> None:
        await self._conn.call(self._send("POST", _checkpoint_url(path) + "/publish"))

    def unpublish_checkpoint(self, path: str) -> APIFuture[None]:
        """Make a published checkpoint private again."""
        return self._future(self.unpublish_checkpoint_async(path))

    async def unpublish_checkpoint_async(self, path: str) -> None:
        await self._conn.call(self._send("DELETE", _checkpoint_url(path) + "/publish"))

    def set_checkpoint_ttl(self, path: str, ttl_seconds: int | None) -> APIFuture[None]:
        """Expire the checkpoint `ttl_seconds` from now (1 h to 10 years); None keeps it."""
        return self._future(self.set_checkpoint_ttl_async(path, ttl_seconds))

    async def set_checkpoint_ttl_async(self, path: str, ttl_seconds: int | None) -> None:
        await self._conn.call(
            self._send("PUT", _checkpoint_url(path) + "/ttl", {"ttl_seconds": ttl_seconds})
        )

    def get_weights_info(self, path: str) -> APIFuture[WeightsInfoResponse]:
        """Base model and LoRA shape of a checkpoint, named by its `tinker://` path or a
        registry reference (`package@alias`, `package:version`)."""
        return self._future(self.get_weights_info_async(path))

    async def get_weights_info_async(self, path: str) -> WeightsInfoResponse:
        async def fetch() -> WeightsInfoResponse:
            response = await self._conn.http.request(
                "POST", "/api/v1/weights_info", json={"tinker_path": path}
            )
            return WeightsInfoResponse.model_validate(response.json())

        return await self._conn.call(fetch())

    def get_external_weights_urls(self, tinker_path: str) -> APIFuture[ExternalWeightsUrlsResponse]:
        """Signed, expiring download URLs for each file of a checkpoint."""
        return self._future(self.get_external_weights_urls_async(tinker_path))

    async def get_external_weights_urls_async(
        self, tinker_path: str
    ) -> ExternalWeightsUrlsResponse:
        return await self._conn.call(
            self._get(
                _checkpoint_url(tinker_path) + "/external_weights_urls", ExternalWeightsUrlsResponse
            )
        )

    def get_download_urls(self, path: str) -> APIFuture[DownloadUrlsResponse]:
        """Signed, expiring URLs for each file of a version and for a tar archive of all.

        Args:
            path: a `tinker://` path or a registry reference (`package@alias`,
                `package:version`) of a version the caller may read.

        Raises:
            NotFoundError: no such version for this caller, it expired, or its files are gone.
        """
        return self._future(self.get_download_urls_async(path))

    async def get_download_urls_async(self, path: str) -> DownloadUrlsResponse:
        async def post() -> DownloadUrlsResponse:
            response = await self._conn.http.request(
                "POST", "/api/v1/registry/download_urls", json={"path": path}
            )
            return DownloadUrlsResponse.model_validate(response.json())

        return await self._conn.call(post())

    def download_checkpoint(
        self,
        path: str,
        destination: str | Path,
        on_progress: ProgressFn | None = None,
        *,
        archive: bool = False,
    ) -> APIFuture[Path]:
        """Download every file of a version into `destination` (created if missing).

        An interrupted download leaves `<file>.part` files; calling again continues them where
        they stopped, and files already in place with the right sha256 are not fetched again.
        Each file is checked against the sha256 the server lists before it is renamed into
        place.

        Args:
            path: a `tinker://` path or a registry reference (`package@alias`,
                `package:version`).
            on_progress: called as bytes arrive with (file, bytes so far, file size or None).
            archive: fetch one tar archive of the version instead, as
                `destination/<name>.tar` (its members checked against the version's files).

        Returns:
            The destination folder, or with `archive` the archive's path.

        Raises:
            NotFoundError: no such version, or its files are gone.
            APIConnectionError: a download failed midway (call again to resume it).
            RequestFailedError: a file arrived with the wrong digest (its partial file is
                removed; call again).
        """
        return self._future(self._download(path, Path(destination), on_progress, archive))

    async def download_checkpoint_async(
        self,
        path: str,
        destination: str | Path,
        on_progress: ProgressFn | None = None,
        *,
        archive: bool = False,
    ) -> Path:
        return await self._conn.call(self._download(path, Path(destination), on_progress, archive))

    async def _download(
        self, path: str, destination: Path, on_progress: ProgressFn | None, archive: bool
    ) -> Path:
        response = await self._conn.http.request(
            "POST", "/api/v1/registry/download_urls", json={"path": path}
        )
        urls = DownloadUrlsResponse.model_validate(response.json())
        # The signed URL is the permission; never send the API key to wherever it points.
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as plain:
            if archive:
                name = unquote(urlsplit(urls.archive_url).path.rsplit("/", 1)[-1])
                return await downloads.download_archive(plain, urls, destination, name, on_progress)
            return await downloads.download_files(plain, urls, destination, on_progress)

    # -- sessions ---------------------------------------------------------------------------

    def list_sessions(self, limit: int = 20, offset: int = 0) -> APIFuture[ListSessionsResponse]:
        """Ids of the caller's sessions, newest first."""
        return self._future(self.list_sessions_async(limit, offset))

    async def list_sessions_async(self, limit: int = 20, offset: int = 0) -> ListSessionsResponse:
        return await self._conn.call(
            self._get("/api/v1/sessions", ListSessionsResponse, limit=limit, offset=offset)
        )

    def get_session(self, session_id: str) -> APIFuture[SessionInfo]:
        """One session: its training runs and samplers (tinker's fields), status and times.

        Raises:
            NotFoundError: no such session (or not yours).
        """
        return self._future(self.get_session_async(session_id))

    async def get_session_async(self, session_id: str) -> SessionInfo:
        return await self._conn.call(self._get(f"/api/v1/sessions/{session_id}", SessionInfo))

    def list_open_sessions(self, limit: int = 100) -> APIFuture[list[SessionInfo]]:
        """The caller's open sessions (each holds a slot of the concurrent-session quota),
        newest first, with their age and last heartbeat.

        Args:
            limit: list at most this many.

        Returns:
            A future of the sessions' `SessionInfo` (id, status, created_at,
            last_heartbeat_at, training runs, samplers, tags).

        Raises:
            AuthenticationError: the API key is not valid.
            APIConnectionError: the server cannot be reached.
        """
        return self._future(self.list_open_sessions_async(limit))

    async def list_open_sessions_async(self, limit: int = 100) -> list[SessionInfo]:
        """`list_open_sessions` for asyncio code."""

        async def fetch() -> list[SessionInfo]:
            listing = await self._get(
                "/api/v1/sessions", ListSessionsResponse, limit=limit, status="open"
            )
            found = await asyncio.gather(
                *(self._get(f"/api/v1/sessions/{sid}", SessionInfo) for sid in listing.sessions),
                return_exceptions=True,
            )
            # A session finished between the two calls reads as not found: leave it out.
            return [
                info for info in found if isinstance(info, SessionInfo) and info.status == "active"
            ]

        return await self._conn.call(fetch())

    def end_session(self, session_id: str) -> APIFuture[FinishSessionResponse]:
        """End one of the caller's sessions, e.g. one left open by a process that was killed,
        which frees its slot of the concurrent-session quota at once. Its training runs are
        unloaded; their saved checkpoints stay. Ending an ended session changes nothing.

        Args:
            session_id: the session, as `list_open_sessions()` or the quota error names it.

        Returns:
            A future of the session's id and status after the call (`finished`, or `expired`
            when it had already timed out).

        Raises:
            NotFoundError: no such session (or not yours).
            APIConnectionError: the server cannot be reached.
        """
        return self._future(self.end_session_async(session_id))

    async def end_session_async(self, session_id: str) -> FinishSessionResponse:
        """`end_session` for asyncio code."""

        async def finish() -> FinishSessionResponse:
            response = await self._conn.http.request(
                "POST",
                f"/api/v1/sessions/{session_id}/finish",
                json={"reason": {"type": "interrupted"}, "detail": "ended with end_session"},
            )
            return FinishSessionResponse.model_validate(response.json())

        return await self._conn.call(finish())

    # -- tinker's names for the path-addressed calls ----------------------------------------

    def delete_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        """`delete_checkpoint(tinker_path)` under tinker's name."""
        return self.delete_checkpoint(tinker_path)

    async def delete_checkpoint_from_tinker_path_async(self, tinker_path: str) -> None:
        await self.delete_checkpoint_async(tinker_path)

    def publish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        """`publish_checkpoint(tinker_path)` under tinker's name."""
        return self.publish_checkpoint(tinker_path)

    async def publish_checkpoint_from_tinker_path_async(self, tinker_path: str) -> None:
        await self.publish_checkpoint_async(tinker_path)

    def unpublish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        """`unpublish_checkpoint(tinker_path)` under tinker's name."""
        return self.unpublish_checkpoint(tinker_path)

    async def unpublish_checkpoint_from_tinker_path_async(self, tinker_path: str) -> None:
        await self.unpublish_checkpoint_async(tinker_path)

    def set_checkpoint_ttl_from_tinker_path(
        self, tinker_path: str, ttl_seconds: int | None
    ) -> APIFuture[None]:
        """`set_checkpoint_ttl(tinker_path, ttl_seconds)` under tinker's name."""
        return self.set_checkpoint_ttl(tinker_path, ttl_seconds)

    async def set_checkpoint_ttl_from_tinker_path_async(
        self, tinker_path: str, ttl_seconds: int | None
    ) -> None:
        await self.set_checkpoint_ttl_async(tinker_path, ttl_seconds)

    def get_weights_info_by_tinker_path(self, tinker_path: str) -> APIFuture[WeightsInfoResponse]:
        """`get_weights_info(tinker_path)` under tinker's name."""
        return self.get_weights_info(tinker_path)

    # -- model registry ---------------------------------------------------------------------

    async def _registry(
        self,
        method: str,
        path: str,
        model: type[T] | None = None,
        *,
        json: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
    ) -> T | None:
        async def send() -> T | None:
            response = await self._conn.http.request(
                method, f"/api/v1/registry/packages{path}", json=json, params=params
            )
            return model.model_validate(response.json()) if model else None  # type: ignore[attr-defined]

        return await self._conn.call(send())

    def list_packages(
        self, tag: str | None = None, limit: int = 100, offset: int = 0
    ) -> APIFuture[RegistryPackagesResponse]:
        """The caller's registry packages by name; with `tag`, only those carrying it."""
        return self._future(self.list_packages_async(tag, limit, offset))

    async def list_packages_async(
        self, tag: str | None = None, limit: int = 100, offset: int = 0
    ) -> RegistryPackagesResponse:
        params = {"limit": limit, "offset": offset} | ({"tag": tag} if tag is not None else {})
        return _got(await self._registry("GET", "", RegistryPackagesResponse, params=params))

    def get_package(self, name: str) -> APIFuture[RegistryPackage]:
        """One package.

        Raises:
            NotFoundError: through the future, for a name the caller has no package of.
        """
        return self._future(self.get_package_async(name))

    async def get_package_async(self, name: str) -> RegistryPackage:
        return _got(await self._registry("GET", _package(name), RegistryPackage))

    def create_package(
        self,
        name: str,
        base_model: str | None = None,
        *,
        description: str | None = None,
        tags: list[str] | None = None,
        training_run_id: str | None = None,
    ) -> APIFuture[RegistryPackage]:
        """A new empty package, to promote versions into.

        Args:
            name: 1-200 letters, digits, `.`, `_`, `-` or `:`, unique among your packages.
            base_model: the base model of every version it will hold; may be left out with
                `training_run_id`.
            training_run_id: make it the package that run's future saves register in (the
                run must not have one yet).

        Raises:
            BadRequestError: through the future, for a taken or invalid name, or a run that
                already has a package.
        """
        request = CreatePackageRequest(
            name=name,
            base_model=base_model,
            description=description,
            tags=tags or [],
            training_run_id=training_run_id,
        )
        return self._future(self.create_package_async(request))

    async def create_package_async(self, request: CreatePackageRequest) -> RegistryPackage:
        body = request.model_dump(mode="json", exclude_none=True)
        return _got(await self._registry("POST", "", RegistryPackage, json=body))

    def update_package(
        self,
        name: str,
        *,
        new_name: str | None = None,
        description: str | None = None,
        tags: list[str] | None = None,
    ) -> APIFuture[RegistryPackage]:
        """Rename, describe or tag a package; what is None stays as it is."""
        request = UpdatePackageRequest(name=new_name, description=description, tags=tags)
        return self._future(self.update_package_async(name, request))

    async def update_package_async(
        self, name: str, request: UpdatePackageRequest
    ) -> RegistryPackage:
        body = request.model_dump(mode="json", exclude_none=True)
        return _got(await self._registry("PATCH", _package(name), RegistryPackage, json=body))

    def delete_package(self, name: str) -> APIFuture[None]:
        """Delete a package and its versions (its name is free again); refused while it has
        aliases."""
        return self._future(self.delete_package_async(name))

    async def delete_package_async(self, name: str) -> None:
        await self._registry("DELETE", _package(name))

    def list_versions(
        self, package: str, status: str | None = None, limit: int = 100, offset: int = 0
    ) -> APIFuture[RegistryVersionsResponse]:
        """A package's versions, newest first; `status` (`ready`, `deleted`, ...) filters."""
        return self._future(self.list_versions_async(package, status, limit, offset))

    async def list_versions_async(
        self, package: str, status: str | None = None, limit: int = 100, offset: int = 0
    ) -> RegistryVersionsResponse:
        params = {"limit": limit, "offset": offset} | ({"status": status} if status else {})
        path = _package(package) + "/versions"
        return _got(await self._registry("GET", path, RegistryVersionsResponse, params=params))

    def get_version(self, package: str, version: int) -> APIFuture[RegistryVersion]:
        """One version: its lineage, files, aliases and where it came from."""
        return self._future(self.get_version_async(package, version))

    async def get_version_async(self, package: str, version: int) -> RegistryVersion:
        return _got(await self._registry("GET", _version(package, version), RegistryVersion))

    def delete_version(self, package: str, version: int) -> APIFuture[None]:
        """Delete a version (its tinker path is free again).

        Raises:
            BadRequestError: through the future, while an alias points at the version.
        """
        return self._future(self.delete_version_async(package, version))

    async def delete_version_async(self, package: str, version: int) -> None:
        await self._registry("DELETE", _version(package, version))

    def set_version_ttl(
        self, package: str, version: int, ttl_seconds: int | None
    ) -> APIFuture[RegistryVersion]:
        """Expire a version `ttl_seconds` from now (1 h to 10 years); None keeps it."""
        return self._future(self.set_version_ttl_async(package, version, ttl_seconds))

    async def set_version_ttl_async(
        self, package: str, version: int, ttl_seconds: int | None
    ) -> RegistryVersion:
        path, body = _version(package, version) + "/ttl", {"ttl_seconds": ttl_seconds}
        return _got(await self._registry("PUT", path, RegistryVersion, json=body))

    def promote_version(
        self, package: str, version: int, target_package: str
    ) -> APIFuture[RegistryVersion]:
        """Add a ready version to another package of the same base model, sharing its files;
        returns the new version."""
        return self._future(self.promote_version_async(package, version, target_package))

    async def promote_version_async(
        self, package: str, version: int, target_package: str
    ) -> RegistryVersion:
        body = PromoteVersionRequest(target_package=target_package).model_dump(mode="json")
        path = _version(package, version) + "/promote"
        return _got(await self._registry("POST", path, RegistryVersion, json=body))

    def list_aliases(self, package: str) -> APIFuture[RegistryAliasesResponse]:
        """A package's aliases, `latest` (the newest ready, unexpired version with its files)
        first."""
        return self._future(self.list_aliases_async(package))

    async def list_aliases_async(self, package: str) -> RegistryAliasesResponse:
        path = _package(package) + "/aliases"
        return _got(await self._registry("GET", path, RegistryAliasesResponse))

    def set_alias(self, package: str, alias: str, version: int) -> APIFuture[RegistryAlias]:
        """Point `alias` at a ready version of the package, creating or moving it.

        Raises:
            BadRequestError: through the future, for `latest` (kept by the registry), an
                invalid name, or a version that is not ready.
        """
        return self._future(self.set_alias_async(package, alias, version))

    async def set_alias_async(self, package: str, alias: str, version: int) -> RegistryAlias:
        body = SetAliasRequest(version=version).model_dump(mode="json")
        return _got(await self._registry("PUT", _alias(package, alias), RegistryAlias, json=body))

    def delete_alias(self, package: str, alias: str) -> APIFuture[None]:
        """Remove an alias (the version it pointed at stays)."""
        return self._future(self.delete_alias_async(package, alias))

    async def delete_alias_async(self, package: str, alias: str) -> None:
        await self._registry("DELETE", _alias(package, alias))

    def get_lineage(self, package: str) -> APIFuture[LineageResponse]:
        """The runs and versions a package's versions came from and went into."""
        return self._future(self.get_lineage_async(package))

    async def get_lineage_async(self, package: str) -> LineageResponse:
        return _got(await self._registry("GET", _package(package) + "/lineage", LineageResponse))


def _checkpoint_url(tinker_path: str) -> str:
    parsed = CheckpointPath.parse(tinker_path)
    return f"/api/v1/training_runs/{parsed.training_run_id}/checkpoints/{parsed.checkpoint_id}"


def _got(value: T | None) -> T:
    assert value is not None
    return value


def _package(name: str) -> str:
    return "/" + quote(name, safe=":")


def _version(package: str, version: int) -> str:
    return f"{_package(package)}/versions/{int(version)}"


def _alias(package: str, alias: str) -> str:
    return f"{_package(package)}/aliases/{quote(alias, safe='')}"
