"""TrainingClient: train one LoRA run, checkpoint it, and sample from it.

Every operation returns an `APIFuture` at once; its submission is queued on the background
loop. Operations execute on the server in the order they were called (seq ids 1, 2, 3, ...),
and their POSTs leave in that order too, but waiting for results is never serialised: call
`forward_backward` then `optim_step`, and wait on both afterwards.

Large batches are split into several requests transparently (see `_chunks`), and their
outputs and metrics merged.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import TypeVar

from pydantic import BaseModel

from treadle._checks import check_callable, check_items, check_type, optional
from treadle._session import Session
from treadle.client._chunks import split_batch
from treadle.client._custom_loss import CustomLossFn, forward_data
from treadle.client._resolved import ResolvedClient
from treadle.client._run_ops import RunOps
from treadle.client.sampling import SamplingClient, open_sampling_client
from treadle.errors import RequestFailedError
from treadle.futures import APIFuture
from treadle.tokenizer import Tokenizer, load_tokenizer
from treadle.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    GetInfoResponse,
    LoadWeightsResponse,
    LossFnType,
    OptimStepResponse,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)

logger = logging.getLogger("treadle")

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class TrainingClient(ResolvedClient):
    """Drives one training run (`model_id` = `{session_id}:train:{n}`).

    Create one with `ServiceClient.create_lora_training_client` or
    `ServiceClient.create_training_client_from_state[_with_optimizer]`.
    """

    def __init__(
        self,
        session: Session,
        info: GetInfoResponse,
        *,
        max_chunk_len: int,
        max_chunk_bytes: int,
        compress: bool = False,
    ) -> None:
        self._session = session
        self._conn = session.connection
        self._info = info
        self.model_id = info.model_id
        self._ops = RunOps(
            session,
            info.model_id,
            max_chunk_len=max_chunk_len,
            max_chunk_bytes=max_chunk_bytes,
            compress=compress,
        )

    def __repr__(self) -> str:
        return f"TrainingClient({self.model_id!r}, base_model={self.base_model!r})"

    @property
    def base_model(self) -> str:
        return self._info.model_data.model_name or self._info.model_name or ""

    # -- forward / backward -----------------------------------------------------------------

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: LossFnType = "cross_entropy",
        loss_fn_config: dict[str, float | str] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Compute the loss and per-token logprobs without gradients.

        Args and errors as for `forward_backward`.
        """
        return self._ops.forward_backward(data, loss_fn, loss_fn_config, forward_only=True)

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: LossFnType = "cross_entropy",
        loss_fn_config: dict[str, float | str] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Compute the loss and accumulate its gradients until the next `optim_step`.

        Args:
            data: the batch, a list of `Datum`; split into several requests when larger than
                the server allows.
            loss_fn: the loss (`LossFnType`). Each needs these `loss_fn_inputs` in every
                datum, each shaped like `target_tokens` (one value per position):

                * `cross_entropy`: `target_tokens`, `weights`.
                * `importance_sampling`, `ppo`, `cispo`, `dro`: `target_tokens`, `logprobs`
                  (the sampler's logprobs of the targets), `advantages`.
                * `gspo`: `target_tokens`, `logprobs`, `advantages`, and optionally
                  `sequence_ratio_mask` (1 where a token counts in the sequence's ratio;
                  without it, the positions with nonzero advantages count).

                `ppo`, `cispo` and `gspo` also take optional `clip_low_threshold` and
                `clip_high_threshold` inputs, one value per datum or one per position, that
                replace `loss_fn_config`'s thresholds for that datum.

                `dro` also needs `loss_fn_config={"beta": ...}`. `stable_reinforce` and
                `custom` are in the type for tinker code, but this server refuses them; use
                `forward_backward_custom` for a loss of your own.
            loss_fn_config: e.g. `{"clip_low_threshold": 0.8}` for ppo, cispo and gspo
                (defaults 0.8 and 1.2 for the low and high clip thresholds).

        Returns:
            A future of the merged output: `loss_fn_outputs[i]["logprobs"]` per datum, and
            metrics such as `loss:sum`.

        Raises:
            InvalidArgumentError: at once, when `data` is not a list of Datum, `loss_fn` is
                not a string, or a datum cannot be encoded.
            RequestRejectedError: through the future, when the server rejects the data or
                loss while running it (a missing input, an unknown loss; the message says
                what to change). It is a `RequestFailedError` with category `user`.
        """
        return self._ops.forward_backward(data, loss_fn, loss_fn_config, forward_only=False)

    def forward_backward_custom(
        self, data: Sequence[Datum], loss_fn: CustomLossFn
    ) -> APIFuture[ForwardBackwardOutput]:
        """Train on a loss computed here, in torch, from the model's per-token logprobs.

        A forward pass returns the logprobs; `loss_fn(data, logprobs)` runs on this machine
        and returns `(loss, metrics)`; its gradient is sent back as cross-entropy weights
        (`weights = -dloss/dlogprobs`), which has the same effect on the adapter. Needs
        `treadle[torch]`. The output's `loss:sum` is your loss; `surrogate_loss:sum` is the
        server's weighted cross-entropy.

        Raises:
            InvalidArgumentError: at once, when `data` is not a list of Datum, a datum has no
                `target_tokens`, or `loss_fn` is not a function.
            Whatever `loss_fn` raises, through the future (the run stays consistent).
        """
        check_items("forward_backward_custom", "data", data, Datum)
        check_callable("forward_backward_custom", "loss_fn", loss_fn)
        fwd_data = forward_data(data)
        chunks = split_batch(fwd_data, self._ops.max_chunk_len, self._ops.max_chunk_bytes)
        bodies = [
            self._ops.encode(chunk, "cross_entropy", None, forward_only=True) for chunk in chunks
        ]
        first = self._ops.reserve(2 * len(chunks))
        return self._ops.spawn(self._ops.run_custom(first, chunks, bodies, list(data), loss_fn))

    async def forward_async(
        self,
        data: Sequence[Datum],
        loss_fn: LossFnType = "cross_entropy",
        loss_fn_config: dict[str, float | str] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """`forward` for asyncio code: `out = await (await client.forward_async(...))`."""
        return self.forward(data, loss_fn, loss_fn_config)

    async def forward_backward_async(
        self,
        data: Sequence[Datum],
        loss_fn: LossFnType = "cross_entropy",
        loss_fn_config: dict[str, float | str] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """`forward_backward` for asyncio code; returns the future."""
        return self.forward_backward(data, loss_fn, loss_fn_config)

    async def forward_backward_custom_async(
        self, data: Sequence[Datum], loss_fn: CustomLossFn
    ) -> APIFuture[ForwardBackwardOutput]:
        """`forward_backward_custom` for asyncio code; returns the future."""
        return self.forward_backward_custom(data, loss_fn)

    # -- optimizer and checkpoints ----------------------------------------------------------

    def optim_step(self, adam_params: AdamParams | None = None) -> APIFuture[OptimStepResponse]:
        """Apply the accumulated gradients with AdamW and clear them.

        Args:
            adam_params: learning rate, betas, eps, weight decay (default: `AdamParams()`).

        Returns:
            A future of the step's metrics (e.g. `grad_norm:mean`).

        Raises:
            InvalidArgumentError: at once, when `adam_params` is not an AdamParams.
        """
        check_type("optim_step", "adam_params", adam_params, optional(AdamParams))
        params = (adam_params or AdamParams()).model_dump(mode="json")
        return self._ops.json_op(
            "/api/v1/optim_step", {"adam_params": params}, OptimStepResponse, "OptimStep"
        )

    def save_state(
        self,
        name: str,
        ttl_seconds: int | None = None,
        overwrite: bool = False,
        user_metadata: dict[str, str] | None = None,
    ) -> APIFuture[SaveWeightsResponse]:
        """Save weights and optimizer state as `tinker://{run}/weights/{name}` (resumable).

        Raises:
            InvalidArgumentError: at once, when `name` is not a string.
            BadRequestError: through the future, when the name is taken (pass
                overwrite=True) or invalid.
        """
        check_type("save_state", "name", name, str)
        body = {
            "path": name,
            "ttl_seconds": ttl_seconds,
            "overwrite": overwrite,
            "user_metadata": user_metadata,
        }
        return self._ops.json_op("/api/v1/save_weights", body, SaveWeightsResponse, "SaveWeights")

    def load_state(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """Replace this run's weights with a checkpoint's (optimizer state untouched).

        Args:
            path: a `tinker://` checkpoint path, or a registry reference (`package@alias`,
                `package:version`).

        Raises:
            InvalidArgumentError: at once, when `path` is not a string.
            NotFoundError: through the future, when no such checkpoint exists (or it is not
                yours); the same class `create_training_client_from_state` raises.
            BadRequestError: through the future, when `path` is neither a `tinker://` path
                nor a registry reference.
        """
        check_type("load_state", "path", path, str)
        return self._ops.json_op(
            "/api/v1/load_weights",
            {"path": path, "optimizer": False},
            LoadWeightsResponse,
            "LoadWeights",
        )

    def load_state_with_optimizer(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """Replace this run's weights and optimizer state with a `save_state` checkpoint's.

        Args:
            path: as for `load_state`; a reference must name a `save_state` version.

        Raises:
            InvalidArgumentError: at once, when `path` is not a string.
            NotFoundError: through the future, when no such checkpoint exists (or it is not
                yours).
            BadRequestError: through the future, when the checkpoint holds no optimizer
                state (a sampler checkpoint) or `path` is neither a `tinker://` path nor a
                registry reference.
        """
        check_type("load_state_with_optimizer", "path", path, str)
        return self._ops.json_op(
            "/api/v1/load_weights",
            {"path": path, "optimizer": True},
            LoadWeightsResponse,
            "LoadWeights",
        )

    def save_weights_for_sampler(
        self,
        name: str,
        ttl_seconds: int | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """Save the adapter as `tinker://{run}/sampler_weights/{name}` for sampling clients.

        Raises:
            InvalidArgumentError: at once, when `name` is not a string.
        """
        check_type("save_weights_for_sampler", "name", name, str)
        body = {
            "path": name,
            "kind": "snapshot",
            "ttl_seconds": ttl_seconds,
            "user_metadata": user_metadata,
        }
        return self._ops.json_op(
            "/api/v1/save_weights_for_sampler",
            body,
            SaveWeightsForSamplerResponse,
            "SaveWeightsForSampler",
        )

    def save_weights_and_get_sampling_client(
        self, name: str | None = None
    ) -> APIFuture[SamplingClient]:
        """Snapshot the current weights into a new sampling session (no named checkpoint).

        Args:
            name: accepted for tinker code and ignored, as tinker's SDK does (with a
                DeprecationWarning): the snapshot is never a named checkpoint. For one, call
                `save_weights_for_sampler(name)` and `create_sampling_client(path)`.

        Returns:
            A future of a SamplingClient that samples from these weights.
        """
        if name is not None:
            warnings.warn(
                "save_weights_and_get_sampling_client(name=...) has no effect: the snapshot is "
                "not a named checkpoint; for one, call save_weights_for_sampler(name) and then "
                "create_sampling_client(path)",
                DeprecationWarning,
                stacklevel=2,
            )
        body = {"kind": "snapshot", "sampling_session_seq_id": self._session.next_sampling_seq_id()}
        saved = self._ops.json_op(
            "/api/v1/save_weights_for_sampler",
            body,
            SaveWeightsForSamplerResponse,
            "SaveWeightsForSampler",
        )
        return saved.map(self._sampling_client_for)

    def create_sampling_client(self, model_path: str) -> SamplingClient:
        """A SamplingClient on a sampler checkpoint (e.g. from `save_weights_for_sampler`), by
        its `tinker://` path or a registry reference (`package@alias`, `package:version`).

        Raises:
            InvalidArgumentError: `model_path` is neither a `tinker://` path nor a registry
                reference.
            NotFoundError: the checkpoint does not exist (or is not yours).
        """
        return self._conn.run(open_sampling_client(self._session, None, model_path))

    async def create_sampling_client_async(self, model_path: str) -> SamplingClient:
        """`create_sampling_client` for asyncio code."""
        return await self._conn.call(open_sampling_client(self._session, None, model_path))

    def live_sampling_client(self) -> SamplingClient:
        """A SamplingClient on this run's current weights (`live:<model_id>`), saving nothing.

        Each sample uses the adapter as the run's last executed optim_step left it, so later
        steps change what it samples; it runs beside the run's training ops, never delaying
        them. Sampling is metered as any sampling is.

        Returns:
            A SamplingClient; its `model_path` is `live:<model_id>`.

        Raises:
            BadRequestError: the run is unloaded, failed or still starting, or its session
                ended (then sample a checkpoint it saved).
            NotFoundError: the run no longer exists (or is not yours).
        """
        return self._conn.run(open_sampling_client(self._session, None, self._live_path))

    async def live_sampling_client_async(self) -> SamplingClient:
        """`live_sampling_client` for asyncio code."""
        return await self._conn.call(open_sampling_client(self._session, None, self._live_path))

    @property
    def _live_path(self) -> str:
        return f"live:{self.model_id}"

    def export(
        self, name: str, ttl_seconds: int | None = None, *, merged: bool = False
    ) -> APIFuture[SaveWeightsExternalResponse]:
        """Export the weights as `tinker://{run}/external_weights/{name}`.

        Args:
            name: the export's name.
            ttl_seconds: delete it after this long (1 hour to 10 years); None keeps it.
            merged: a Hugging Face model folder with the adapter merged into the base weights
                (loads with `transformers` alone) instead of a PEFT adapter folder (loads with
                `peft.PeftModel.from_pretrained` on the base model, or vLLM).

        Download it with `RestClient.download_checkpoint` or `treadle download PATH`. Like every
        save, it is registered on the server as a new version of the run's model.
        """
        check_type("export", "name", name, str)
        body: dict[str, object] = {"path": name, "ttl_seconds": ttl_seconds}
        if merged:
            body["merged"] = True
        return self._ops.json_op(
            "/api/v1/save_weights_external",
            body,
            SaveWeightsExternalResponse,
            "SaveWeightsExternal",
        )

    save_weights_external = export

    async def optim_step_async(
        self, adam_params: AdamParams | None = None
    ) -> APIFuture[OptimStepResponse]:
        """`optim_step` for asyncio code; returns the future."""
        return self.optim_step(adam_params)

    async def save_state_async(
        self,
        name: str,
        ttl_seconds: int | None = None,
        overwrite: bool = False,
        user_metadata: dict[str, str] | None = None,
    ) -> APIFuture[SaveWeightsResponse]:
        """`save_state` for asyncio code; returns the future."""
        return self.save_state(
            name, ttl_seconds=ttl_seconds, overwrite=overwrite, user_metadata=user_metadata
        )

    async def load_state_async(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """`load_state` for asyncio code; returns the future."""
        return self.load_state(path)

    async def load_state_with_optimizer_async(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """`load_state_with_optimizer` for asyncio code; returns the future."""
        return self.load_state_with_optimizer(path)

    async def save_weights_for_sampler_async(
        self,
        name: str,
        ttl_seconds: int | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """`save_weights_for_sampler` for asyncio code; returns the future."""
        return self.save_weights_for_sampler(
            name, ttl_seconds=ttl_seconds, user_metadata=user_metadata
        )

    async def save_weights_and_get_sampling_client_async(
        self, name: str | None = None
    ) -> SamplingClient:
        """`save_weights_and_get_sampling_client`, awaited: returns the SamplingClient."""
        return await self.save_weights_and_get_sampling_client(name)

    async def export_async(
        self, name: str, ttl_seconds: int | None = None, *, merged: bool = False
    ) -> APIFuture[SaveWeightsExternalResponse]:
        """`export` for asyncio code; returns the future."""
        return self.export(name, ttl_seconds=ttl_seconds, merged=merged)

    save_weights_external_async = export_async

    # -- information ------------------------------------------------------------------------

    def get_info(self) -> GetInfoResponse:
        """The run's description (base model, LoRA rank), fetched at creation."""
        return self._info

    async def get_info_async(self) -> GetInfoResponse:
        return self._info

    def get_tokenizer(self) -> Tokenizer:
        """The base model's tokenizer, downloaded from the server.

        Returns:
            A `treadle.tokenizer.Tokenizer`: `encode(str) -> list[int]`,
            `decode(list[int]) -> str` and `apply_chat_template`, as transformers' tokenizers
            (which tinker's `get_tokenizer` returns) have.

        Raises:
            MissingDependencyError: `treadle[tokenizer]` is not installed (also an
                `ImportError`).
        """
        return self._conn.run(load_tokenizer(self._conn.http, self.base_model))

    async def get_tokenizer_async(self) -> Tokenizer:
        return await self._conn.call(load_tokenizer(self._conn.http, self.base_model))

    # -- internals --------------------------------------------------------------------------

    def _sampling_client_for(self, saved: SaveWeightsForSamplerResponse) -> SamplingClient:
        if saved.sampling_session_id is None:
            raise RequestFailedError(
                "the server returned no sampling_session_id for the snapshot",
                category="server",
                request_id="",
            )
        return SamplingClient(self._conn, saved.sampling_session_id, self.base_model)
