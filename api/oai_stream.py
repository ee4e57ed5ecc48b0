"""`/oai/v1` completions streamed as server-sent events while the model generates.

The op is submitted with its tokens published as they are chosen (`api.oai_serving`); each
progress message's newly settled text (`api.oai_text.StreamedChoice`) goes out at once, and
when the op's result is recorded, whatever remains of each choice's text, its finish reason
and, when asked, the usage. The result is authoritative: if it does not continue what was
sent (a re-run after a worker failure chose other tokens), the stream ends with an error event
in OpenAI's format rather than with wrong text. What the chunks look like is the route's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from api.chat_templates import ServedTokenizer
from api.deps import AppState
from api.oai_params import Sampling
from api.oai_serving import Sampled, follow, start_streamed
from api.oai_text import Finished, StreamedChoice, engine_stop, finish
from api.oai_types import ErrorBody, ErrorDetail
from core.apikeys import Principal
from core.errors import ErrorCode, TreadleError
from scheduler.notify import Progress


def _event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"


def _error_event(message: str, kind: str, code: ErrorCode) -> str:
    return _event(ErrorBody(error=ErrorDetail(message=message, type=kind, param=None, code=code)))


Delta = Callable[[int, str], BaseModel]
"""A chunk carrying new text of one choice (by index)."""
Ending = Callable[[int, str, Finished], BaseModel]
"""A choice's last chunk: the rest of its text, its finish reason (and logprobs)."""


async def stream(
    state: AppState,
    principal: Principal,
    model: str,
    prompt: list[int],
    sampling: Sampling,
    tok: ServedTokenizer,
    chunks: tuple[list[BaseModel], Delta, Ending, Callable[[Sampled], BaseModel] | None],
) -> StreamingResponse:
    """Sample with the tokens streamed as they are chosen. `chunks` writes the route's chunks:
    those that open the stream, new text, each choice's ending, and the usage (when asked).
    The op is submitted and its first progress or result awaited before the response starts,
    so that a refusal is an HTTP error."""
    opening, delta, ending, usage = chunks
    watch = await start_streamed(
        state, principal, model, prompt, sampling, engine_stop(sampling.stop, tok)
    )
    events = follow(state, principal, watch)
    first = await anext(events)
    choices = [StreamedChoice(tok, sampling.stop) for _ in range(sampling.n)]

    async def lines() -> AsyncIterator[str]:
        try:
            for chunk in opening:
                yield _event(chunk)
            event = first
            while not isinstance(event, Sampled):
                if deltas := "".join(_deltas(event, choices, delta)):
                    yield deltas
                event = await anext(events)
            done = [finish(tok, seq, sampling.stop) for seq in event.response.sequences]
            rests = [c.rest(d) for c, d in zip(choices, done, strict=False)]
            if any(rest is None for rest in rests):
                yield _error_event(
                    "the sample was re-run after a worker failure and chose other tokens than "
                    "those already sent; retry the request with the same seed",
                    "server_error",
                    ErrorCode.INTERNAL_ERROR,
                )
                return
            for i, (rest, d) in enumerate(zip(rests, done, strict=True)):
                yield _event(ending(i, rest or "", d))
            if usage is not None:
                yield _event(usage(event))
            yield "data: [DONE]\n\n"
        except TreadleError as exc:
            yield _error_event(exc.message, "invalid_request_error", exc.code)
        except RuntimeError as exc:
            yield _error_event(str(exc), "server_error", ErrorCode.INTERNAL_ERROR)
        finally:
            await events.aclose()

    return StreamingResponse(
        lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def _deltas(progress: Progress, choices: list[StreamedChoice], delta: Delta) -> list[str]:
    """The events of one progress message: each choice's newly settled text, if any."""
    out = []
    for index, (offset, tokens) in sorted(progress.items()):
        if 0 <= index < len(choices) and (text := choices[index].add(offset, tokens)):
            out.append(_event(delta(index, text)))
    return out
