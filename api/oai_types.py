"""The OpenAI wire types `/oai/v1` speaks: requests, responses, stream chunks and errors.

Requests forbid unknown fields, as OpenAI does ("Unrecognized request argument"), except the
few harmless ones declared here (`user`, `metadata`, `store`, `service_tier`, ...). Fields that
would change the output and that Treadle's sampler cannot honour (penalties, `logit_bias`,
tools, response formats, ...) are declared too, so that `api.oai_params` can refuse them by
name when they are set to anything but their default, instead of ignoring them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from treadle.types.bounds import Seed


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class _Response(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class StreamOptions(_Request):
    include_usage: bool = False
    include_obfuscation: bool | None = None
    """Accepted and unused: chunks are never padded."""


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(default=None, max_length=200)
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


class _Sampling(_Request):
    """What chat and text completions share."""

    model: str = Field(min_length=1, max_length=1000)
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    # The sampler's seeds are unsigned 64-bit, as on the Tinker protocol's wire.
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Harmless: recorded nowhere, they change nothing in the output (as with OpenAI).
    user: str | None = Field(default=None, max_length=1000)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = Field(default=None, max_length=100)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] = Field(min_length=1)
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None


FinishReason = Literal["stop", "length"]


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChunkDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(_Response):
    index: int
    delta: ChunkDelta
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None


class Completion(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(_Response):
    message: str = Field(description="What went wrong and what to change.")
    type: str = Field(
        description="`invalid_request_error`, `authentication_error`, `permission_error`, "
        "`not_found_error`, `rate_limit_error` or `server_error`."
    )
    param: str | None = Field(description="The request parameter at fault, when there is one.")
    code: str | None = Field(description="Treadle's error code (docs/protocol.md).")


class ErrorBody(_Response):
    """The body of every error `/oai/v1` answers, in OpenAI's format."""

    error: ErrorDetail
