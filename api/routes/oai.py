"""The OpenAI-compatible API, `/oai/v1`: models, chat completions and text completions.

Each completion is one `sample` op on Treadle's sampling path (`api.oai_serving`), so it is
batched, placed and metered exactly as `/api/v1/asample` is; `usage` is what the ledger
recorded for the op. Streams are server-sent events in OpenAI's format, sent as the model
generates (`api.oai_stream`).
"""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from api import oai_params
from api.chat_templates import ServedTokenizer
from api.deps import AppState, State
from api.oai_params import ParamError, Sampling
from api.oai_serving import (
    OaiPrincipal,
    Sampled,
    base_model_of,
    submit_sample,
    tokenizer_for,
    wait_for,
)
from api.oai_stream import stream
from api.oai_text import Finished, engine_stop, finish
from api.oai_types import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ErrorBody,
    ModelCard,
    ModelList,
    TokenLogprob,
    Usage,
)
from core import runs
from core.apikeys import Principal
from core.tables import (
    ModelAlias,
    ModelPackage,
    ModelVersion,
    RunStatus,
    SamplingSession,
    Session,
    SessionStatus,
    TrainingRun,
    VersionStatus,
)

router = APIRouter(prefix="/oai/v1", tags=["openai"])

_ERRORS = {
    400: "The request is invalid or asks for what this server cannot do; `error.param` names "
    "the parameter.",
    401: "The API key is missing, malformed, unknown or revoked.",
    402: "The tenant's spend limit is reached.",
    403: "The key may not do this (a disabled tenant, or one of its limits).",
    404: "No such model, or another tenant's (they look alike).",
    413: "The request body exceeds this server's size limit.",
    429: "The sampling queue is full; retry after `Retry-After` seconds.",
}
_STREAM: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion; with `stream=true`, server-sent events as the model "
        "generates (`data: {chunk}` lines, then `data: [DONE]`, or a `data: {error}` line "
        "when the completion fails after its stream started).",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorBody, "description": _ERRORS[s]} for s in statuses}


_COMPLETION_ERRORS = _STREAM | _errors(400, 401, 402, 403, 404, 413, 429)
_LISTED_PER_KIND = 500


# --- models ----------------------------------------------------------------------------------


def _models(state: AppState, principal: Principal) -> ModelList:
    now = state.clock.now()
    created = int(now.timestamp())
    cards = [
        ModelCard(id=m, created=created, owned_by="treadle") for m in state.settings.offered_models
    ]
    tenant = principal.tenant_id
    with state.database.reader() as db:
        samplers = db.execute(
            select(SamplingSession.id, SamplingSession.created_at)
            .join(Session, Session.id == SamplingSession.session_id)
            .where(SamplingSession.tenant_id == tenant, Session.status == SessionStatus.ACTIVE)
            .order_by(SamplingSession.created_at.desc())
            .limit(_LISTED_PER_KIND)
        ).all()
        saved = db.execute(
            select(ModelVersion.tinker_path, ModelVersion.created_at)
            .where(
                ModelVersion.tenant_id == tenant,
                ModelVersion.kind == "sampler",
                ModelVersion.status == VersionStatus.READY,
                ModelVersion.tinker_path.is_not(None),
                (ModelVersion.expires_at.is_(None)) | (ModelVersion.expires_at > now),
            )
            .order_by(ModelVersion.created_at.desc())
            .limit(_LISTED_PER_KIND)
        ).all()
        live = db.execute(
            select(TrainingRun.id, TrainingRun.created_at)
            .join(Session, Session.id == TrainingRun.session_id)
            .where(
                TrainingRun.tenant_id == tenant,
                TrainingRun.status == RunStatus.ACTIVE,
                Session.status == SessionStatus.ACTIVE,
            )
            .order_by(TrainingRun.created_at.desc())
            .limit(_LISTED_PER_KIND)
        ).all()
        aliases = db.execute(
            select(ModelPackage.name, ModelAlias.name, ModelVersion.created_at)
            .join(ModelPackage, ModelPackage.id == ModelAlias.package_id)
            .join(ModelVersion, ModelVersion.id == ModelAlias.version_id)
            .where(ModelAlias.tenant_id == tenant, ModelPackage.deleted_at.is_(None))
            .order_by(ModelPackage.name, ModelAlias.name)
            .limit(_LISTED_PER_KIND)
        ).all()
    cards += [ModelCard(id=i, created=int(t.timestamp()), owned_by="you") for i, t in samplers]
    cards += [ModelCard(id=str(p), created=int(t.timestamp()), owned_by="you") for p, t in saved]
    cards += [
        ModelCard(id=runs.LIVE_PREFIX + r, created=int(t.timestamp()), owned_by="you")
        for r, t in live
    ]
    cards += [
        ModelCard(id=f"{p}@{a}", created=int(t.timestamp()), owned_by="you") for p, a, t in aliases
    ]
    return ModelList(data=cards)


@router.get("/models", response_model=ModelList, responses=_errors(401, 403))
def list_models(principal: OaiPrincipal, state: State) -> ModelList:
    """Base models, the caller's open sampling sessions, saved sampler checkpoints, live
    training runs (`live:<run id>`) and registry aliases: every `model` a completion may name."""
    return _models(state, principal)


# --- turning sampled tokens into text ----------------------------------------------------------


def _token_logprobs(tok: ServedTokenizer, done: Finished) -> list[TokenLogprob]:
    out = []
    for token, logprob in zip(done.tokens, done.logprobs, strict=False):
        piece = tok.piece(token)
        out.append(
            TokenLogprob(token=piece, logprob=logprob, bytes=list(piece.encode()), top_logprobs=[])
        )
    return out


def _usage(sampled: Sampled) -> Usage:
    return Usage(
        prompt_tokens=sampled.prompt_tokens,
        completion_tokens=sampled.completion_tokens,
        total_tokens=sampled.prompt_tokens + sampled.completion_tokens,
    )


async def _sample(
    state: AppState,
    principal: Principal,
    model: str,
    prompt: list[int],
    sampling: Sampling,
    tok: ServedTokenizer,
) -> Sampled:
    request_id = await run_in_threadpool(
        submit_sample, state, principal, model, prompt, sampling, engine_stop(sampling.stop, tok)
    )
    return await wait_for(state, principal, request_id)


# --- chat completions ------------------------------------------------------------------------


@router.post("/chat/completions", response_model=ChatCompletion, responses=_COMPLETION_ERRORS)
async def chat_completions(
    body: ChatCompletionRequest, principal: OaiPrincipal, state: State
) -> ChatCompletion | StreamingResponse:
    """A chat completion of `messages`, rendered with the base model's chat template."""
    sampling = oai_params.chat(body)
    conversation = oai_params.messages(body)
    base_model = await run_in_threadpool(base_model_of, state, principal, body.model)
    tok = await run_in_threadpool(tokenizer_for, state, base_model)
    prompt = tok.encode(tok.render(conversation), special_tokens=False)
    completion_id, created = "chatcmpl-" + _request_suffix(), int(state.clock.now().timestamp())

    def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=completion_id, created=created, model=body.model, choices=choices, usage=usage
        )

    def logprobs(d: Finished) -> ChoiceLogprobs | None:
        return ChoiceLogprobs(content=_token_logprobs(tok, d)) if sampling.logprobs else None

    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        opening: list[BaseModel] = [
            chunk([ChunkChoice(index=i, delta=ChunkDelta(role="assistant", content=""))])
            for i in range(sampling.n)
        ]

        def delta(i: int, text: str) -> BaseModel:
            return chunk([ChunkChoice(index=i, delta=ChunkDelta(content=text))])

        def ending(i: int, rest: str, d: Finished) -> BaseModel:
            # The logprobs of all the choice's tokens come with its end: progress carries none.
            return chunk(
                [
                    ChunkChoice(
                        index=i,
                        delta=ChunkDelta(content=rest) if rest else ChunkDelta(),
                        logprobs=logprobs(d),
                        finish_reason=d.finish_reason,
                    )
                ]
            )

        def usage(sampled: Sampled) -> BaseModel:
            return chunk([], _usage(sampled))

        return await stream(
            state,
            principal,
            body.model,
            prompt,
            sampling,
            tok,
            (opening, delta, ending, usage if include_usage else None),
        )
    sampled = await _sample(state, principal, body.model, prompt, sampling, tok)
    done = [finish(tok, seq, sampling.stop) for seq in sampled.response.sequences]
    return ChatCompletion(
        id=completion_id,
        created=created,
        model=body.model,
        choices=[
            ChatChoice(
                index=i,
                message=AssistantMessage(content=d.text),
                finish_reason=d.finish_reason,
                logprobs=logprobs(d),
            )
            for i, d in enumerate(done)
        ],
        usage=_usage(sampled),
    )


# --- text completions ------------------------------------------------------------------------


def _prompt_tokens(body: CompletionRequest, tok: ServedTokenizer) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise ParamError("send one prompt per request (a string or token ids)", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tok.encode(prompt, special_tokens=True)
    vocabulary = tok.tokenizer.get_vocab_size()
    tokens = [int(t) for t in prompt]
    if any(not 0 <= t < vocabulary for t in tokens):
        raise ParamError(f"prompt token ids must lie in 0..{vocabulary - 1}", param="prompt")
    return tokens


@router.post("/completions", response_model=Completion, responses=_COMPLETION_ERRORS)
async def completions(
    body: CompletionRequest, principal: OaiPrincipal, state: State
) -> Completion | StreamingResponse:
    """A text completion of `prompt` (text or token ids), with no chat template."""
    sampling = oai_params.completion(body)
    base_model = await run_in_threadpool(base_model_of, state, principal, body.model)
    tok = await run_in_threadpool(tokenizer_for, state, base_model)
    prompt = _prompt_tokens(body, tok)
    completion_id, created = "cmpl-" + _request_suffix(), int(state.clock.now().timestamp())

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        return Completion(
            id=completion_id, created=created, model=body.model, choices=choices, usage=usage
        )

    def logprobs(d: Finished) -> CompletionLogprobs | None:
        if not sampling.logprobs:
            return None
        offsets, at = [], 0
        for piece in d.pieces:
            offsets.append(at)
            at += len(piece)
        return CompletionLogprobs(
            tokens=[tok.piece(t) for t in d.tokens],
            token_logprobs=d.logprobs,
            top_logprobs=None,
            text_offset=offsets,
        )

    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        def delta(i: int, text: str) -> BaseModel:
            return chunk([CompletionChoice(index=i, text=text, finish_reason=None)])

        def ending(i: int, rest: str, d: Finished) -> BaseModel:
            return chunk(
                [
                    CompletionChoice(
                        index=i, text=rest, finish_reason=d.finish_reason, logprobs=logprobs(d)
                    )
                ]
            )

        def usage(sampled: Sampled) -> BaseModel:
            return chunk([], _usage(sampled))

        return await stream(
            state,
            principal,
            body.model,
            prompt,
            sampling,
            tok,
            ([], delta, ending, usage if include_usage else None),
        )
    sampled = await _sample(state, principal, body.model, prompt, sampling, tok)
    done = [finish(tok, seq, sampling.stop) for seq in sampled.response.sequences]
    return chunk(
        [
            CompletionChoice(
                index=i, text=d.text, finish_reason=d.finish_reason, logprobs=logprobs(d)
            )
            for i, d in enumerate(done)
        ],
        _usage(sampled),
    )


def _request_suffix() -> str:
    return secrets.token_hex(12)
