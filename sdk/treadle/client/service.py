"""ServiceClient: the entry point. Holds the server address and key, and starts the session.

```python
with treadle.ServiceClient(base_url="http://127.0.0.1:8000", api_key="tml-...") as service:
    trainer = service.create_lora_training_client("treadle/tiny-1m", rank=8)
```

The session is created on first need and kept alive by background heartbeats; leaving the
`with` block (or `close()`) finishes it, which frees its slot of the tenant's quota.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import httpx

from treadle import _exit
from treadle._checks import build, check_type
from treadle._connection import Connection
from treadle._http import DEFAULT_TIMEOUT_SECONDS, RetryPolicy
from treadle._polling import retrieve, submit
from treadle._session import FinishStatus, Session
from treadle.client.rest import RestClient
from treadle.client.sampling import SamplingClient, open_sampling_client
from treadle.client.training import TrainingClient
from treadle.errors import AuthenticationError, TreadleError
from treadle.futures import APIFuture
from treadle.types import (
    CreateModelRequest,
    CreateModelResponse,
    GetInfoResponse,
    LoadWeightsRequest,
    LoadWeightsResponse,
    LoraConfig,
    ServerCapabilities,
)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
logger = logging.getLogger("treadle")


class ServiceClient:
    """Platform settings and the session; creates training, sampling and REST clients.

    Args:
        base_url: the server; defaults to `$TREADLE_BASE_URL`, then `$TINKER_BASE_URL`, then
            `http://127.0.0.1:8000`.
        api_key: defaults to `$TREADLE_API_KEY`.
        project_id, tags, user_metadata, display_name: recorded on the session.
        retry: how long transient failures (connection errors, 5xx, 429) are retried.
        timeout: read timeout of ordinary requests, in seconds.
        connect_timeout: seconds to wait for the server's first answer before raising
            APIConnectionError (None: `$TREADLE_CONNECT_TIMEOUT`, else 10). Only the first
            contact is bounded this way; later transient failures follow `retry`.
        transport: an httpx transport to use instead of the network (proxies, tests).
        headers: extra headers sent on every request.

    Raises:
        AuthenticationError: no API key was given or found in the environment.
        InvalidArgumentError: connect_timeout (or `$TREADLE_CONNECT_TIMEOUT`) is not a
            positive number.

    The session ends when the process exits without `close()` too (normal exit, an uncaught
    exception, Ctrl-C, SIGTERM), best effort; see the SDK README, "Sessions".
    """

    def __init__(
        self,
        user_metadata: dict[str, Any] | None = None,
        project_id: str | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        tags: list[str] | None = None,
        display_name: str | None = None,
        retry: RetryPolicy | None = None,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        connect_timeout: float | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        url, key = resolve_credentials(base_url, api_key)
        self._conn = Connection(
            url,
            key,
            retry=retry,
            timeout=timeout,
            transport=transport,
            headers=headers,
            connect_timeout=connect_timeout,
            url_source=resolve_base_url(base_url)[1],
        )
        self._session = Session(
            self._conn,
            tags=tags,
            user_metadata=user_metadata,
            project_id=project_id,
            display_name=display_name,
        )
        _exit.install()

    @property
    def base_url(self) -> str:
        return self._conn.base_url

    @property
    def session_id(self) -> str | None:
        """The session's id once created (None before the first training/sampling client)."""
        return self._session.session_id

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close("success")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.close("interrupted", repr(exc))
        else:
            self.close("errored", repr(exc))

    def close(self, status: FinishStatus = "success", detail: str | None = None) -> APIFuture[None]:
        """Finish the session on the server and release this client's resources.

        Clients created from this one stop working. Idempotent. When the server cannot be
        reached, a warning is logged and the session ends on its own once its heartbeats stop.

        Returns:
            A future that is already done: the session is finished when `close` returns
            (tinker's `close` returns a future to wait on, so `close(...).result()` works).
        """
        if self._conn.closed:
            return APIFuture.completed(None)
        try:
            self._conn.run(self._session.finish(status, detail), timeout=60)
        except (TreadleError, TimeoutError) as exc:
            logger.warning("could not finish session %s: %s", self._session.session_id, exc)
        finally:
            self._conn.close()
        return APIFuture.completed(None)

    # -- capabilities -----------------------------------------------------------------------

    def get_server_capabilities(self) -> ServerCapabilities:
        """The base models this server offers."""
        return self._conn.run(self._capabilities())

    async def get_server_capabilities_async(self) -> ServerCapabilities:
        """`get_server_capabilities` for asyncio code."""
        return await self._conn.call(self._capabilities())

    async def _capabilities(self) -> ServerCapabilities:
        response = await self._conn.http.request("GET", "/api/v1/get_server_capabilities")
        return ServerCapabilities.model_validate(response.json())

    # -- training clients -------------------------------------------------------------------

    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, Any] | None = None,
    ) -> TrainingClient:
        """Start a new LoRA training run on `base_model`.

        Args:
            base_model: a model from `get_server_capabilities()`.
            rank: LoRA rank (the tenant's maximum applies).
            seed: seed of the adapter's initialisation (None: the server picks).
            train_mlp, train_attn, train_unembed: which layers get adapters.
            user_metadata: stored on the run (e.g. `{"renderer_name": ...}`).

        Returns:
            A TrainingClient for the new run (it also answers `.result()` and `await`, as
            the future of one that tinker's SDK returns does).

        Raises:
            InvalidArgumentError: at once, when `base_model` is not a string or `rank` not
                an integer.
            BadRequestError: the model is not served here or the rank is out of range.
            QuotaExceededError: the tenant's concurrent session limit is reached.
        """
        lora = build(
            "create_lora_training_client",
            LoraConfig,
            rank=rank,
            seed=seed,
            train_mlp=train_mlp,
            train_attn=train_attn,
            train_unembed=train_unembed,
        )
        return self._conn.run(self._create_lora(base_model, lora, user_metadata))

    async def create_lora_training_client_async(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, Any] | None = None,
    ) -> TrainingClient:
        """`create_lora_training_client` for asyncio code."""
        lora = build(
            "create_lora_training_client",
            LoraConfig,
            rank=rank,
            seed=seed,
            train_mlp=train_mlp,
            train_attn=train_attn,
            train_unembed=train_unembed,
        )
        return await self._conn.call(self._create_lora(base_model, lora, user_metadata))

    def create_training_client_from_state(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, Any] | None = None,
    ) -> TrainingClient:
        """A new run starting from a checkpoint's weights, with a fresh optimizer.

        Args:
            path: a `tinker://<run>/weights/<name>` checkpoint (yours or a published one),
                or a registry reference to one of yours: `package@alias` (`@latest` is the
                newest ready, unexpired version with its files) or `package:version`.
            base_model: the checkpoint's base model; None reads it from the checkpoint.
            user_metadata: stored on the new run.

        Returns:
            A TrainingClient for the new run (it also answers `.result()`, as tinker's future
            of one does).

        Raises:
            NotFoundError: no such checkpoint (or not yours).
        """
        return self._conn.run(self._create_from_state(path, False, base_model, user_metadata))

    def create_training_client_from_state_with_optimizer(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, Any] | None = None,
    ) -> TrainingClient:
        """A new run resuming a `save_state` checkpoint: weights and optimizer state.

        Args and return as for `create_training_client_from_state`.

        Raises:
            NotFoundError: no such checkpoint (or not yours), or a reference naming an
                expired, failed or deleted version.
            BadRequestError: the checkpoint holds no optimizer state (a sampler checkpoint).
        """
        return self._conn.run(self._create_from_state(path, True, base_model, user_metadata))

    async def create_training_client_from_state_async(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, Any] | None = None,
    ) -> TrainingClient:
        """`create_training_client_from_state` for asyncio code."""
        return await self._conn.call(
            self._create_from_state(path, False, base_model, user_metadata)
        )

    async def create_training_client_from_state_with_optimizer_async(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, Any] | None = None,
    ) -> TrainingClient:
        """`create_training_client_from_state_with_optimizer` for asyncio code."""
        return await self._conn.call(self._create_from_state(path, True, base_model, user_metadata))

    # -- sampling and REST ------------------------------------------------------------------

    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None
    ) -> SamplingClient:
        """Sample from a base model, or from saved weights.

        Args:
            model_path: saved weights (first, as in tinker's SDK): a
                `tinker://.../sampler_weights/...` checkpoint, or a registry reference
                (`package@alias`, `package:version`); or `live:<training run id>` for a
                training run's current weights (`TrainingClient.live_sampling_client`).
            base_model: a model from `get_server_capabilities()`.

        Returns:
            A SamplingClient (it also answers `.result()`, as tinker's future of one does).

        Raises:
            InvalidArgumentError: neither or both of base_model and model_path were given, or
                model_path is neither a `tinker://` path nor a registry reference.
            BadRequestError: model_path names a live run that was unloaded or whose session
                ended.
            NotFoundError: the checkpoint or live run does not exist (or is not yours).
        """
        return self._conn.run(open_sampling_client(self._session, base_model, model_path))

    async def create_sampling_client_async(
        self, model_path: str | None = None, base_model: str | None = None
    ) -> SamplingClient:
        """`create_sampling_client` for asyncio code."""
        return await self._conn.call(open_sampling_client(self._session, base_model, model_path))

    def create_rest_client(self) -> RestClient:
        """A RestClient on this client's connection (runs, checkpoints, downloads)."""
        return RestClient(self._conn)

    # -- internals --------------------------------------------------------------------------

    async def _create_lora(
        self, base_model: str, lora: LoraConfig, user_metadata: dict[str, Any] | None
    ) -> TrainingClient:
        check_type("create_lora_training_client", "base_model", base_model, str)
        session_id = await self._session.ensure()
        request = CreateModelRequest(
            session_id=session_id,
            model_seq_id=self._session.next_model_seq_id(),
            base_model=base_model,
            user_metadata=user_metadata,
            lora_config=lora,
        )
        handle = await submit(
            self._conn.http,
            "/api/v1/create_model",
            json=request.model_dump(mode="json", exclude_none=True),
        )
        created = await retrieve(
            self._conn.http,
            handle.request_id,
            lambda r: CreateModelResponse.model_validate(r.json()),
            request_type="CreateModel",
        )
        return await self._training_client(created.model_id)

    async def _create_from_state(
        self,
        path: str,
        optimizer: bool,
        base_model: str | None,
        user_metadata: dict[str, Any] | None,
    ) -> TrainingClient:
        check_type("create_training_client_from_state", "path", path, str)
        session_id = await self._session.ensure()
        model_seq_id = self._session.next_model_seq_id()
        request = LoadWeightsRequest(
            session_id=session_id,
            model_seq_id=model_seq_id,
            path=path,
            optimizer=optimizer,
            base_model=base_model,
            user_metadata=user_metadata,
        )
        handle = await submit(
            self._conn.http,
            "/api/v1/load_weights",
            json=request.model_dump(mode="json", exclude_none=True),
        )
        await retrieve(
            self._conn.http,
            handle.request_id,
            lambda r: LoadWeightsResponse.model_validate(r.json()),
            request_type="LoadWeights",
        )
        return await self._training_client(handle.model_id or f"{session_id}:train:{model_seq_id}")

    async def _training_client(self, model_id: str) -> TrainingClient:
        response = await self._conn.http.request(
            "POST", "/api/v1/get_info", json={"model_id": model_id, "type": "get_info"}
        )
        info = GetInfoResponse.model_validate(response.json())
        max_len, max_bytes = await self._conn.chunk_limits()
        config = await self._conn.config()
        return TrainingClient(
            self._session,
            info,
            max_chunk_len=max_len,
            max_chunk_bytes=max_bytes,
            compress=bool(config.proto_compress_fwdbwd),
        )


def resolve_base_url(base_url: str | None, argument: str = "base_url=") -> tuple[str, str]:
    """The server URL and where it came from: `argument`, `TREADLE_BASE_URL`,
    `TINKER_BASE_URL` or the default (named in the error when the server cannot be reached)."""
    if base_url:
        return base_url.rstrip("/"), argument
    for variable in ("TREADLE_BASE_URL", "TINKER_BASE_URL"):
        value = os.environ.get(variable)
        if value:
            return value.rstrip("/"), variable
    return DEFAULT_BASE_URL, "default; neither base_url= nor TREADLE_BASE_URL is set"


def resolve_credentials(base_url: str | None, api_key: str | None) -> tuple[str, str]:
    """The base URL and API key from the arguments, else the environment
    (`TREADLE_BASE_URL`, then `TINKER_BASE_URL`; `TREADLE_API_KEY`).

    Raises:
        AuthenticationError: no API key anywhere.
    """
    url = resolve_base_url(base_url)[0]
    key = api_key or os.environ.get("TREADLE_API_KEY")
    if not key:
        raise AuthenticationError(
            "no API key: pass api_key=... or set TREADLE_API_KEY (keys look like tml-<id>-<secret>)",
            status_code=401,
        )
    return url.rstrip("/"), key
