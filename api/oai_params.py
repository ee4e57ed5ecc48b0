"""The OpenAI sampling parameters `/oai/v1` honours, and the refusal of those it cannot.

A parameter that would change the output and that Treadle's sampler does not implement is
refused by name with a 400 when it is set to anything but its default, never ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from api.oai_types import ChatCompletionRequest, CompletionRequest
from core.errors import ErrorCode, InvalidInput

MAX_N = 128
DEFAULT_MAX_TOKENS = 256
"""When a request sets no `max_tokens`: a bound, where OpenAI's is the model's context."""
MAX_STOP_SEQUENCES = 4


class ParamError(InvalidInput):
    """A request parameter `/oai/v1` refuses; `param` names it in OpenAI's error body."""

    def __init__(
        self, message: str, *, param: str | None = None, code: ErrorCode | None = None
    ) -> None:
        super().__init__(message, code=code)
        self.param = param


@dataclasses.dataclass(frozen=True)
class Sampling:
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    stop: list[str]
    seed: int | None
    logprobs: bool


def _unsupported(param: str, why: str) -> ParamError:
    return ParamError(
        f"{param} is not supported by this server ({why}); leave it unset",
        param=param,
        code=ErrorCode.UNSUPPORTED,
    )


def _refuse_set(body: Any, defaults: dict[str, tuple[Any, ...]], why: str) -> None:
    for name, allowed in defaults.items():
        if getattr(body, name) not in allowed:
            raise _unsupported(name, why)


def _common(body: ChatCompletionRequest | CompletionRequest, max_tokens: int | None) -> Sampling:
    _refuse_set(
        body,
        {"presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0)},
        "the sampler applies no penalties",
    )
    if body.logit_bias:
        raise _unsupported("logit_bias", "the sampler takes no per-token biases")
    if not 1 <= body.n <= MAX_N:
        raise ParamError(f"n={body.n} is outside 1..{MAX_N}; ask for fewer choices", param="n")
    temperature = 1.0 if body.temperature is None else body.temperature
    if not 0 <= temperature <= 2:
        raise ParamError(
            f"temperature={temperature} is outside 0..2; pass a value in 0..2", param="temperature"
        )
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0 < top_p <= 1:
        raise ParamError(f"top_p={top_p} is outside (0, 1]; pass a value above 0", param="top_p")
    if max_tokens is not None and max_tokens < 1:
        raise ParamError(f"max_tokens={max_tokens} must be at least 1", param="max_tokens")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_SEQUENCES or any(not s for s in stop):
        raise ParamError(
            f"stop takes up to {MAX_STOP_SEQUENCES} non-empty strings; pass fewer", param="stop"
        )
    if body.stream_options is not None and not body.stream:
        raise ParamError("stream_options is only allowed with stream=true", param="stream_options")
    return Sampling(
        n=body.n,
        temperature=temperature,
        top_p=top_p,
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        stop=stop,
        seed=body.seed,
        logprobs=False,
    )


def chat(body: ChatCompletionRequest) -> Sampling:
    """The sampling a chat completion asks for; refuses what cannot be honoured."""
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise ParamError(
            "pass max_completion_tokens or max_tokens, not both", param="max_completion_tokens"
        )
    no_tools = "the served models are sampled as plain text, with no tool calling"
    for name in ("tools", "functions"):
        if getattr(body, name):
            raise _unsupported(name, no_tools)
    _refuse_set(
        body,
        {
            "tool_choice": (None, "none"),
            "function_call": (None, "none"),
            "parallel_tool_calls": (None,),
            "reasoning_effort": (None,),
            "audio": (None,),
            "prediction": (None,),
            "web_search_options": (None,),
            "verbosity": (None,),
        },
        "the served models are sampled as plain text",
    )
    if body.response_format not in (None, {"type": "text"}):
        raise _unsupported("response_format", "output is never constrained to a format")
    if body.modalities not in (None, ["text"]):
        raise _unsupported("modalities", "the served models write text only")
    if body.top_logprobs:
        raise _unsupported(
            "top_logprobs",
            "the sampler reports the sampled tokens' logprobs only; pass logprobs=true "
            "without top_logprobs",
        )
    if body.top_logprobs is not None and not body.logprobs:
        raise ParamError(
            "top_logprobs needs logprobs=true; set logprobs or drop top_logprobs",
            param="top_logprobs",
        )
    for i, message in enumerate(body.messages):
        if message.role in ("tool", "function") or message.tool_calls or message.tool_call_id:
            raise _unsupported(f"messages.{i}", "no tool calling")
    sampling = _common(body, body.max_completion_tokens or body.max_tokens)
    return dataclasses.replace(sampling, logprobs=bool(body.logprobs))


def completion(body: CompletionRequest) -> Sampling:
    """The sampling a text completion asks for; refuses what cannot be honoured."""
    if body.echo:
        raise _unsupported("echo", "the prompt is not repeated in the answer")
    if body.suffix:
        raise _unsupported("suffix", "no insertion: text is only appended")
    if body.best_of not in (None, body.n):
        raise _unsupported("best_of", "no server-side ranking of choices; pass n instead")
    if body.logprobs:
        raise _unsupported(
            "logprobs",
            "the sampler reports the sampled tokens' logprobs only: pass logprobs=0 for those",
        )
    sampling = _common(body, body.max_tokens)
    return dataclasses.replace(sampling, logprobs=body.logprobs == 0)


def messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as a chat template reads it (text content only)."""
    out = []
    for i, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise _unsupported(
                        f"messages.{i}.content.{j}", f"{part.type!r} parts: send text parts only"
                    )
                texts.append(part.text)
            content = "".join(texts)
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        out.append(entry)
    return out
