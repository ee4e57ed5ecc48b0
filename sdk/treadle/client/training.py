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
from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic import BaseModel

from treadle._session import Session
from treadle.client._chunks import split_batch
from treadle.client._custom_loss import CustomLossFn, forward_data
from treadle.client._run_ops import RunOps
from treadle.client.sampling import SamplingClient, open_sampling_client
from treadle.futures import APIFuture
from treadle.tokenizer import load_tokenizer
from treadle.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    GetInfoResponse,
    LoadWeightsResponse,
    OptimStepResponse,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)

logger = logging.getLogger("treadle")

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class TrainingClient:
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
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, float | str] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Compute the loss and per-token logprobs without gradients.

        Args and errors as for `forward_backward`.
        """
        return self._ops.forward_backward(data, loss_fn, loss_fn_config, forward_only=True)

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, float | str] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Compute the loss and accumulate its gradients until the next `optim_step`.

        Args:
            data: the batch; split into several requests when larger than the server allows.
            loss_fn: `cross_entropy`, `importance_sampling`, `ppo`, `cispo`, `dro`, `gspo`...
            loss_fn_config: e.g. `{"clip_low_threshold": 0.8}` for ppo.

        Returns:
            A future of the merged output: `loss_fn_outputs[i]["logprobs"]` per datum, and
            metrics such as `loss:sum`.

        Raises:
            ValueError: at once, when a datum cannot be encoded.
            RequestFailedError: through the future, when the server rejects the data or loss
                (category `user`, with what to change).
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
            ValueError: at once, when a datum has no `target_tokens`.
            Whatever `loss_fn` raises, through the future (the run stays consistent).
        """
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
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, float | str] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """`forward` for asyncio code: `out = await (await client.forward_async(...))`."""
        return self.forward(data, loss_fn, loss_fn_config)

    async def forward_backward_async(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
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

        Returns:
            A future of the step's metrics (e.g. `grad_norm:mean`).
        """
        params = (adam_params or AdamParams()).model_dump(mode="json")
        return self._ops.json_op(
            "/api/v1/optim_step", {"adam_params": params}, OptimStepResponse, "OptimStep"
        )

    def save_state(
        self,
        name: str,
        *,
        ttl_seconds: int | None = None,
        overwrite: bool = False,
        user_metadata: dict[str, str] | None = None,
    ) -> APIFuture[SaveWeightsResponse]:
        """Save weights and optimizer state as `tinker://{run}/weights/{name}` (resumable).

        Raises (through the future):
            BadRequestError: the name is taken (pass overwrite=True) or invalid.
        """
        body = {
            "path": name,
            "ttl_seconds": ttl_seconds,
            "overwrite": overwrite,
            "user_metadata": user_metadata,
        }
        return self._ops.json_op("/api/v1/save_weights", body, SaveWeightsResponse, "SaveWeights")

    def load_state(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """Replace this run's weights with a checkpoint's (optimizer state untouched)."""
        return self._ops.json_op(
            "/api/v1/load_weights",
            {"path": path, "optimizer": False},
            LoadWeightsResponse,
            "LoadWeights",
        )

    def load_state_with_optimizer(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """Replace this run's weights and optimizer state with a `save_state` checkpoint's."""
        return self._ops.json_op(
            "/api/v1/load_weights",
            {"path": path, "optimizer": True},
            LoadWeightsResponse,
            "LoadWeights",
        )

    def save_weights_for_sampler(
        self,
        name: str,
        *,
        ttl_seconds: int | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """Save the adapter as `tinker://{run}/sampler_weights/{name}` for sampling clients."""
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

    def save_weights_and_get_sampling_client(self) -> APIFuture[SamplingClient]:
        """Snapshot the current weights into a new sampling session (no named checkpoint).

        Returns:
            A future of a SamplingClient that samples from these weights.
        """
        body = {"kind": "snapshot", "sampling_session_seq_id": self._session.next_sampling_seq_id()}
        saved = self._ops.json_op(
            "/api/v1/save_weights_for_sampler",
            body,
            SaveWeightsForSamplerResponse,
            "SaveWeightsForSampler",
        )
        return saved.map(self._sampling_client_for)

    def create_sampling_client(self, model_path: str) -> SamplingClient:
        """A SamplingClient on a sampler checkpoint (e.g. from `save_weights_for_sampler`).

        Raises:
            NotFoundError: the checkpoint does not exist (or is not yours).
        """
        return self._conn.run(open_sampling_client(self._session, None, model_path))

    async def create_sampling_client_async(self, model_path: str) -> SamplingClient:
        """`create_sampling_client` for asyncio code."""
        return await self._conn.call(open_sampling_client(self._session, None, model_path))

    def export(
        self, name: str, *, ttl_seconds: int | None = None, merged: bool = False
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
        *,
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
        *,
        ttl_seconds: int | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """`save_weights_for_sampler` for asyncio code; returns the future."""
        return self.save_weights_for_sampler(
            name, ttl_seconds=ttl_seconds, user_metadata=user_metadata
        )

    async def save_weights_and_get_sampling_client_async(self) -> SamplingClient:
        """`save_weights_and_get_sampling_client`, awaited: returns the SamplingClient."""
        return await self.save_weights_and_get_sampling_client()

    async def export_async(
        self, name: str, *, ttl_seconds: int | None = None, merged: bool = False
    ) -> APIFuture[SaveWeightsExternalResponse]:
        """`export` for asyncio code; returns the future."""
        return self.export(name, ttl_seconds=ttl_seconds, merged=merged)

    # -- information ------------------------------------------------------------------------

    def get_info(self) -> GetInfoResponse:
        """The run's description (base model, LoRA rank), fetched at creation."""
        return self._info

    async def get_info_async(self) -> GetInfoResponse:
        return self._info

    def get_tokenizer(self) -> Any:
        """The base model's `tokenizers.Tokenizer`, downloaded from the server.

        Raises:
            ImportError: `treadle[tokenizer]` is not installed.
        """
        return self._conn.run(load_tokenizer(self._conn.http, self.base_model))

    async def get_tokenizer_async(self) -> Any:
        return await self._conn.call(load_tokenizer(self._conn.http, self.base_model))

    # -- internals --------------------------------------------------------------------------

    def _sampling_client_for(self, saved: SaveWeightsForSamplerResponse) -> SamplingClient:
        if saved.sampling_session_id is None:
            raise ValueError("the server returned no sampling_session_id for the snapshot")
        return SamplingClient(self._conn, saved.sampling_session_id, self.base_model)
