"""SamplingClient: sample and score prompts on a base model or saved weights.

Samples are independent: any number run at once (bounded by `max_concurrent_requests`), in
no particular order. Each request carries a seq id unique within this client, so a submission
retried after a lost answer is deduplicated by the server.

A SamplingClient pickles (API key included, like the tinker SDK's), so it can be handed to
worker processes; an unpickled copy uses a process-wide connection and a fresh seq-id range
(`clone_id * 1e9 + n`). Only the original keeps the session alive with heartbeats.
"""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Any

import httpx

from treadle._checks import build, check_type, optional
from treadle._connection import Connection, shared_connection
from treadle._polling import retrieve, spawn_tallied, submit
from treadle._session import Session
from treadle.client._resolved import ResolvedClient
from treadle.errors import InvalidArgumentError, RequestFailedError
from treadle.futures import APIFuture
from treadle.tokenizer import Tokenizer, load_tokenizer
from treadle.types import (
    TINKER_SCHEME,
    CreateSamplingSessionResponse,
    GetSamplerResponse,
    ModelInput,
    SampleRequest,
    SampleResponse,
    SamplingParams,
)
from treadle.wire import decode_sample_response

_CLONE_STRIDE = 1_000_000_000
DEFAULT_MAX_CONCURRENT_REQUESTS = 512


class SamplingClient(ResolvedClient):
    """Samples from one sampling session (a base model, or saved weights: a `tinker://` path
    or a registry reference).

    Create one with `ServiceClient.create_sampling_client` or
    `TrainingClient.save_weights_and_get_sampling_client`.
    """

    def __init__(
        self,
        connection: Connection,
        sampling_session_id: str,
        base_model: str,
        *,
        model_path: str | None = None,
        clone_id: int = 0,
        max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
    ) -> None:
        self._conn = connection
        self.sampling_session_id = sampling_session_id
        self.base_model = base_model
        self.model_path = model_path
        self._max_concurrent = max_concurrent_requests
        self._seq_lock = threading.Lock()
        self._next_seq = clone_id * _CLONE_STRIDE
        self._limiter: asyncio.Semaphore | None = None

    def __repr__(self) -> str:
        source = self.model_path or self.base_model
        return f"SamplingClient({self.sampling_session_id!r}, {source!r})"

    # -- pickling ---------------------------------------------------------------------------

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (
            _unpickle,
            (
                self._conn.base_url,
                self._conn.api_key,
                self.sampling_session_id,
                self.base_model,
                self.model_path,
                self._max_concurrent,
            ),
        )

    # -- sampling ---------------------------------------------------------------------------

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        *,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
    ) -> APIFuture[SampleResponse]:
        """Sample `num_samples` continuations of `prompt`.

        Args:
            prompt: the tokens to continue.
            num_samples: independent continuations to draw.
            sampling_params: max_tokens, temperature, top_k, top_p, stop, seed.
            include_prompt_logprobs: also return each prompt token's logprob.
            topk_prompt_logprobs: also return the top-k logprobs at each prompt position.
            topk_sample_logprobs: also return the top-k logprobs at each sampled position.

        Returns:
            A future of the `SampleResponse`; each sequence has its tokens, their logprobs,
            its stop reason and a `sequence_id`.

        Raises:
            InvalidArgumentError: at once, when `prompt` is not a ModelInput,
                `sampling_params` not a SamplingParams, or a count is not an int.
            RequestFailedError: through the future, when the server could not sample (e.g.
                the prompt is longer than the model's context).
            BadRequestError: through the future, when the request was refused (e.g.
                num_samples out of range).
        """
        check_type("sample", "prompt", prompt, ModelInput)
        check_type("sample", "num_samples", num_samples, int)
        check_type("sample", "sampling_params", sampling_params, optional(SamplingParams))
        check_type("sample", "topk_prompt_logprobs", topk_prompt_logprobs, int)
        check_type("sample", "topk_sample_logprobs", topk_sample_logprobs, int)
        request = build(
            "sample",
            SampleRequest,
            prompt=prompt,
            num_samples=num_samples,
            sampling_params=sampling_params or SamplingParams(),
            sampling_session_id=self.sampling_session_id,
            seq_id=self._reserve(),
            prompt_logprobs=include_prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            topk_sample_logprobs=topk_sample_logprobs,
        )
        body = request.model_dump(mode="json", exclude_none=True)
        return spawn_tallied(self._conn.loop, self._sample(body))

    async def sample_async(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        *,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
    ) -> SampleResponse:
        """`sample`, awaited: returns the response itself."""
        return await self.sample(
            prompt,
            num_samples,
            sampling_params,
            include_prompt_logprobs=include_prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            topk_sample_logprobs=topk_sample_logprobs,
        )

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        """The logprob of each token of `prompt` given the ones before it.

        Returns:
            A future of one entry per prompt token; the first is None (nothing predicts it).

        Raises:
            InvalidArgumentError: at once, when `prompt` is not a ModelInput.
        """
        check_type("compute_logprobs", "prompt", prompt, ModelInput)
        future = self.sample(prompt, 1, SamplingParams(max_tokens=1), include_prompt_logprobs=True)
        return future.map(_prompt_logprobs)

    async def compute_logprobs_async(self, prompt: ModelInput) -> list[float | None]:
        """`compute_logprobs`, awaited."""
        return await self.compute_logprobs(prompt)

    def get_base_model(self) -> str:
        """The base model this client samples from."""
        return self.base_model

    async def get_base_model_async(self) -> str:
        """`get_base_model` for asyncio code."""
        return self.base_model

    def get_tokenizer(self) -> Tokenizer:
        """The base model's tokenizer (see `TrainingClient.get_tokenizer`), downloaded from the
        server (needs `treadle[tokenizer]`)."""
        return self._conn.run(load_tokenizer(self._conn.http, self.base_model))

    # -- internals --------------------------------------------------------------------------

    def _reserve(self) -> int:
        with self._seq_lock:
            value = self._next_seq
            self._next_seq += 1
            return value

    async def _sample(self, body: dict[str, Any]) -> SampleResponse:
        if self._limiter is None:
            self._limiter = asyncio.Semaphore(self._max_concurrent)
        async with self._limiter:
            handle = await submit(self._conn.http, "/api/v1/asample", json=body)
            response = await retrieve(
                self._conn.http,
                handle.request_id,
                _decode_sample,
                request_type="Sample",
                protobuf=True,
            )
        ids = handle.sample_sequence_ids or []
        for sequence, sequence_id in zip(response.sequences, ids, strict=False):
            sequence.sequence_id = sequence_id
        return response


def _names_weights(path: str) -> bool:
    """Whether `path` reads as a tinker path or a registry reference (the server checks the
    rest): a package name holds no `@`, and a reference without one ends in `:<version>`."""
    return path.startswith(TINKER_SCHEME) or "@" in path or ":" in path


async def open_sampling_client(
    session: Session, base_model: str | None, model_path: str | None
) -> SamplingClient:
    """Open a sampling session on a base model, or on saved weights: a `tinker://` path or a
    registry reference (`package@alias`, `package:version`).

    Raises:
        InvalidArgumentError: neither or both of base_model and model_path, or a model_path
            that is neither a `tinker://` path nor a registry reference.
        NotFoundError: the checkpoint does not exist (or is not yours).
    """
    check_type("create_sampling_client", "base_model", base_model, optional(str))
    check_type("create_sampling_client", "model_path", model_path, optional(str))
    if (base_model is None) == (model_path is None):
        raise InvalidArgumentError(
            "pass exactly one of base_model (sample the base model) or model_path "
            "(a tinker:// sampler checkpoint or a registry reference)"
        )
    if model_path is not None and not _names_weights(model_path):
        raise InvalidArgumentError(
            f"model_path {model_path!r} is neither a {TINKER_SCHEME} path (e.g. the `path` of "
            "save_weights_for_sampler's result) nor a registry reference (package@alias or "
            "package:version)"
        )
    http = session.connection.http
    body: dict[str, Any] = {
        "session_id": await session.ensure(),
        "sampling_session_seq_id": session.next_sampling_seq_id(),
        "type": "create_sampling_session",
    }
    if base_model is not None:
        body["base_model"] = base_model
    if model_path is not None:
        body["model_path"] = model_path
    response = await http.request("POST", "/api/v1/create_sampling_session", json=body)
    sampler_id = CreateSamplingSessionResponse.model_validate(response.json()).sampling_session_id
    if base_model is None:
        described = await http.request("GET", f"/api/v1/samplers/{sampler_id}")
        base_model = GetSamplerResponse.model_validate(described.json()).base_model
    return SamplingClient(session.connection, sampler_id, base_model, model_path=model_path)


def _decode_sample(response: httpx.Response) -> SampleResponse:
    if "json" in response.headers.get("content-type", ""):
        return SampleResponse.model_validate(response.json())
    return decode_sample_response(response.content)


def _prompt_logprobs(response: SampleResponse) -> list[float | None]:
    if response.prompt_logprobs is None:
        raise RequestFailedError(
            "the server returned no prompt logprobs for compute_logprobs", category="server"
        )
    return list(response.prompt_logprobs)


def _unpickle(
    base_url: str,
    api_key: str,
    sampling_session_id: str,
    base_model: str,
    model_path: str | None,
    max_concurrent: int,
) -> SamplingClient:
    return SamplingClient(
        shared_connection(base_url, api_key),
        sampling_session_id,
        base_model,
        model_path=model_path,
        clone_id=random.randint(1, _CLONE_STRIDE - 1),
        max_concurrent_requests=max_concurrent,
    )
