"""Sampling wire types: sampling sessions, sample requests and their results.

A sampling session (`{session_id}:sample:{n}`) pins the weights a client samples from: a base
model, a `tinker://` sampler checkpoint, or an ephemeral save. `SampleRequest` is JSON;
`SampleResponse` is the Python-side form of a result that travels as protobuf (see
`treadle.wire`).
"""

from __future__ import annotations

from typing import Literal, TypeAlias

from pydantic import Field

from treadle.types._base import WireRequest, WireResponse
from treadle.types.bounds import (
    BaseModelName,
    CheckpointPathText,
    SamplerSeqId,
    Seed,
    ServerId,
    SessionCounter,
    TopkCount,
)
from treadle.types.model_input import ModelInput
from treadle.types.tensor import TensorData

StopReason: TypeAlias = Literal["stop", "length"]

TOPK_EMPTY_TOKEN = 0
TOPK_EMPTY_LOGPROB = -99999.0
"""Top-k matrices fill empty slots with token 0 and this logprob."""

TopkEntries: TypeAlias = list[tuple[int, float]]
"""Up to k `(token_id, logprob)` pairs for one position, most likely first."""


class CreateSamplingSessionRequest(WireRequest):
    session_id: ServerId
    sampling_session_seq_id: SessionCounter
    """Per-session counter from 0, shared with ephemeral save_weights_for_sampler."""
    base_model: BaseModelName | None = None
    model_path: CheckpointPathText | None = None
    """A `tinker://` sampler checkpoint; None samples the base model."""
    type: Literal["create_sampling_session"] = "create_sampling_session"


class CreateSamplingSessionResponse(WireResponse):
    sampling_session_id: str
    type: Literal["create_sampling_session"] = "create_sampling_session"


class GetSamplerResponse(WireResponse):
    sampler_id: str
    base_model: str
    model_path: str | None = None


class JoinSamplingSessionRequest(WireRequest):
    sampling_session_id: ServerId
    type: Literal["join_sampling_session"] = "join_sampling_session"


class JoinSamplingSessionResponse(WireResponse):
    client_counter: int = Field(ge=1)
    """Unique among the session's clients (the original is 0); becomes the clone id."""
    type: Literal["join_sampling_session"] = "join_sampling_session"


class SamplingParams(WireRequest):
    """How `SamplingClient.sample` draws tokens.

    Attributes:
        max_tokens: the most tokens to generate per sequence.
        seed: makes the draw reproducible (None: random).
        stop: strings or token ids that end a sequence.
        temperature: the softmax temperature; lower is more deterministic.
        top_k: sample among the k likeliest tokens only.
        top_p: sample within the smallest set whose probability reaches top_p.
    """

    max_tokens: int | None = None
    seed: Seed | None = None
    stop: str | list[str] | list[int] | None = None
    """None stops at EOS only; `[]` disables every stop, EOS included."""
    temperature: float = 1.0
    top_k: int = -1
    """-1: no limit."""
    top_p: float = 1.0


class SampleRequest(WireRequest):
    num_samples: int = 1
    prompt: ModelInput
    sampling_params: SamplingParams
    base_model: BaseModelName | None = None
    model_path: CheckpointPathText | None = None
    sampling_session_id: ServerId | None = None
    seq_id: SamplerSeqId | None = None
    """Unique per sampling client (from 0; clones use clone_id * 1e9 + n): store as int64."""
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: TopkCount = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: TensorData | None = None
    """int64 ids `[len(prompt) - 1, K]` whose prompt logprobs to return; -1 asks nothing."""
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    """Score only the last N prompt tokens; earlier prompt logprobs are None (NaN on wire)."""
    record_stability_info: bool | None = None
    type: Literal["sample"] = "sample"


class SampledSequence(WireResponse):
    """One sampled continuation.

    Attributes:
        stop_reason: `length` (max_tokens reached) or `stop` (a stop sequence or EOS).
        tokens: the generated token ids (the prompt not included).
        logprobs: the logprob of each generated token under the sampled model.
        topk_logprobs: the top-k alternatives at each position, when asked for.
        sequence_id: the server's id of this sequence.
    """

    stop_reason: StopReason
    tokens: list[int]
    logprobs: list[float] | None = None
    topk_logprobs: list[TopkEntries | None] | None = None
    """Per sampled position; None where the engine reported nothing."""
    sequence_id: str | None = None
    """Not on the protobuf wire: clients take it from the future's `sample_sequence_ids`."""


class PromptAltTokens(WireResponse):
    """k independent draws at every prompt position after the first."""

    tokens: TensorData
    """int64 `[len(prompt) - 1, k]`."""
    logprobs: TensorData
    """float32 `[len(prompt) - 1, k]`."""


class SampleResponse(WireResponse):
    """The result of `SamplingClient.sample`.

    Attributes:
        sequences: `num_samples` continuations (`SampledSequence`).
        prompt_logprobs: with `include_prompt_logprobs=True`, each prompt token's logprob.
        topk_prompt_logprobs: with `topk_prompt_logprobs=k`, the top-k at each prompt position.
        prompt_cache_hit_tokens: prompt tokens served from the server's prefix cache.
    """

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    """One entry per prompt token; None where not computed (position 0 at least)."""
    topk_prompt_logprobs: list[TopkEntries | None] | None = None
    prompt_cache_hit_tokens: int = 0
    target_prompt_logprobs: TensorData | None = None
    prompt_alt_tokens: PromptAltTokens | None = None
