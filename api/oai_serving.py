"""How `/oai/v1` samples: the caller's key, the model it names, and one `sample` op.

A request names a model: a base model, a sampling session of the caller's
(`<session>:sample:<n>`), a saved checkpoint (`tinker://…`) or a registry reference
(`package@alias`, `package:version`). All but a sampling session are sampled in the key's
*serving* session (`core.sessions.serving_session`), in one sampling session per base model or
checkpoint, reused by every later request. The op is submitted exactly as `/api/v1/asample`
submits it (same checks, queue limit, spend estimate), so it is batched, placed and metered
like any sample; the request then waits for its result and the ledger's usage of it. A
streamed request's op is submitted under an id chosen beforehand, whose progress (the tokens
chosen so far, `scheduler.notify`) is watched from before the op exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import func, select
from sqlalchemy.orm import Session as OrmSession
from starlette.concurrency import run_in_threadpool

from api.chat_templates import ServedTokenizer, load
from api.deps import API_KEY_HEADER, AppState, State, authenticate
from api.oai_params import Sampling
from api.submission import in_submission, open_live_sampler, queue_sample, read_op, require_session
from billing import estimate
from core import checkpoints, references, runs, sessions
from core.apikeys import Principal
from core.errors import AuthenticationFailed, ErrorCode, InvalidInput, NotFound
from core.ids import new_request_id
from core.tables import ModelPackage, ModelVersion, SamplingSession
from scheduler.futures import FutureState
from scheduler.notify import Progress, ProgressWatch
from scheduler.ops import PROTO
from scheduler.served import tokenizer_key
from scheduler.submit import Submitted
from treadle.types import ModelInput, SampleRequest, SampleResponse, SamplingParams
from treadle.wire import decode_sample_response

BEARER = HTTPBearer(
    scheme_name="Bearer",
    description="A Treadle API key as OpenAI clients send it: `Authorization: Bearer <key>`.",
    auto_error=False,
)

_RECHECK_SECONDS = 1.0


def get_principal(
    request: Request,
    state: State,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)],
    header: Annotated[str | None, Security(API_KEY_HEADER)],
) -> Principal:
    if bearer is None and request.headers.get("authorization"):
        # A credential that cannot be read is refused, never passed over for another one.
        raise AuthenticationFailed(
            "the Authorization header holds no bearer token; send `Authorization: Bearer <key>` "
            "or leave the header out and send the key in X-API-Key"
        )
    raw = bearer.credentials if bearer is not None else header
    if not raw:
        raise AuthenticationFailed(
            "missing API key; send it as `Authorization: Bearer <key>` (the OpenAI client's "
            "api_key) or in the X-API-Key header"
        )
    return authenticate(state, raw)


OaiPrincipal = Annotated[Principal, Depends(get_principal)]


class ModelNotFound(NotFound):
    """A model that names nothing the caller may sample (a foreign one looks the same)."""

    param = "model"


def _model_not_found(model: str) -> ModelNotFound:
    return ModelNotFound(
        f"model {model[:300]!r} not found; GET /oai/v1/models lists the models this key can use"
    )


@dataclasses.dataclass(frozen=True)
class Target:
    sampler_id: str
    base_model: str


def _serving_sampler(
    db: OrmSession,
    state: AppState,
    principal: Principal,
    *,
    base_model: str,
    model_path: str | None,
    version: ModelVersion | None,
    live_run: str | None = None,
) -> SamplingSession:
    """The serving session's sampling session for a base model, a checkpoint or a live run
    (`live:<run id>`), created on first use."""
    serving = sessions.serving_session(
        db,
        state.clock,
        tenant_id=principal.tenant_id,
        api_key_id=principal.key_id,
        ttl_seconds=state.settings.session_ttl_seconds,
    )
    query = select(SamplingSession).where(
        SamplingSession.session_id == serving.id,
        SamplingSession.base_model == base_model,
    )
    if version is not None:
        query = query.where(SamplingSession.model_version_id == version.id)
    else:
        query = query.where(
            SamplingSession.model_version_id.is_(None),
            SamplingSession.training_run_id == live_run
            if live_run is not None
            else SamplingSession.training_run_id.is_(None),
        )
    existing = db.scalar(query.limit(1))
    if existing is not None:
        if live_run is not None:
            runs.require_live(db, principal.tenant_id, live_run)
        return existing
    used = db.scalar(
        select(func.max(SamplingSession.sampling_session_seq_id)).where(
            SamplingSession.session_id == serving.id
        )
    )
    seq = 0 if used is None else used + 1
    if live_run is not None:
        return open_live_sampler(
            db, state, principal, session_id=serving.id, seq=seq, run_id=live_run
        )
    return runs.create_sampling_session(
        db,
        state.clock,
        tenant_id=principal.tenant_id,
        session_id=serving.id,
        seq=seq,
        base_model=base_model,
        model_path=model_path,
        training_run_id=None if version is None else version.training_run_id,
        model_version_id=None if version is None else version.id,
    )


def resolve_target(db: OrmSession, state: AppState, principal: Principal, model: str) -> Target:
    """The sampling session a request's `model` is sampled in (in the submitting transaction)."""
    if model in state.settings.offered_models:
        sampler = _serving_sampler(
            db, state, principal, base_model=model, model_path=None, version=None
        )
        return Target(sampler.id, model)
    live_run = runs.live_run_id(model)
    if live_run is not None:
        run = runs.require_live(db, principal.tenant_id, live_run)
        sampler = _serving_sampler(
            db,
            state,
            principal,
            base_model=run.base_model,
            model_path=model,
            version=None,
            live_run=run.id,
        )
        return Target(sampler.id, run.base_model)
    if ":sample:" in model and not model.startswith("tinker://"):
        try:
            sampler = runs.get_sampling_session(db, principal.tenant_id, model)
        except NotFound:
            raise _model_not_found(model) from None
        require_session(db, state, principal, sampler.session_id)
        if sampler.model_version_id is not None:
            checkpoints.require_sampleable(
                db.get(ModelVersion, sampler.model_version_id),
                principal.tenant_id,
                state.clock,
                sampler.model_path,
            )
        return Target(sampler.id, sampler.base_model)
    if not (model.startswith("tinker://") or references.is_reference(model)):
        raise _model_not_found(model)
    version = checkpoints.resolve(db, state.clock, principal.tenant_id, model)
    package = db.get(ModelPackage, version.package_id)
    assert package is not None
    sampler = _serving_sampler(
        db, state, principal, base_model=package.base_model, model_path=model, version=version
    )
    return Target(sampler.id, package.base_model)


def base_model_of(state: AppState, principal: Principal, model: str) -> str:
    """The base model a request's `model` samples, without creating anything."""
    if model in state.settings.offered_models:
        return model
    with state.database.reader() as db:
        if ":sample:" in model and not model.startswith("tinker://"):
            try:
                return runs.get_sampling_session(db, principal.tenant_id, model).base_model
            except NotFound:
                raise _model_not_found(model) from None
        live_run = runs.live_run_id(model)
        if live_run is not None:
            return runs.require_live(db, principal.tenant_id, live_run).base_model
        if not (model.startswith("tinker://") or references.is_reference(model)):
            raise _model_not_found(model)
        version = checkpoints.resolve(db, state.clock, principal.tenant_id, model)
        package = db.get(ModelPackage, version.package_id)
        assert package is not None
        return package.base_model


def tokenizer_for(state: AppState, base_model: str) -> ServedTokenizer:
    served = state.settings.model_aliases.get(base_model, base_model)
    try:
        folder = state.store.open_dir(state.store.uri(tokenizer_key(served)))
    except FileNotFoundError as exc:
        raise InvalidInput(
            f"the tokenizer of {base_model!r} is not published yet; retry once a worker serving "
            "it has started",
            code=ErrorCode.UNSUPPORTED,
        ) from exc
    return load(base_model, folder)


@dataclasses.dataclass(frozen=True)
class Sampled:
    response: SampleResponse
    prompt_tokens: int
    completion_tokens: int


def submit_sample(
    state: AppState,
    principal: Principal,
    model: str,
    prompt: list[int],
    sampling: Sampling,
    stop: list[str] | None,
    streamed_as: str | None = None,
) -> str:
    """Submit one `sample` op for the request; returns its request id. `streamed_as` is the id
    under which the caller watches the op's progress (`start_streamed`)."""
    request = SampleRequest(
        num_samples=sampling.n,
        prompt=ModelInput.from_ints(prompt),
        sampling_params=SamplingParams(
            max_tokens=sampling.max_tokens,
            seed=sampling.seed,
            stop=stop,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
        ),
    )
    usage = (
        estimate.sample(len(prompt), sampling.max_tokens, sampling.n)
        if principal.spend_limited
        else None
    )

    def work(db: OrmSession) -> tuple[str, Submitted]:
        target = resolve_target(db, state, principal, model)
        sampler = db.get(SamplingSession, target.sampler_id)
        assert sampler is not None
        return sampler.id, queue_sample(
            db, state, principal, sampler, request, usage, streamed_as=streamed_as
        )

    _, submitted = in_submission(state, work)
    return submitted.request_id


async def wait_for(state: AppState, principal: Principal, request_id: str) -> Sampled:
    """The op's result and its ledger usage, once it finished; its failure as an error."""
    event = state.notifier.subscribe(request_id)
    try:
        while True:
            future = await run_in_threadpool(read_op, state, principal.tenant_id, request_id)
            if future.done:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), _RECHECK_SECONDS)
            event.clear()
    finally:
        state.notifier.unsubscribe(request_id, event)
    return _sampled(future)


async def start_streamed(
    state: AppState,
    principal: Principal,
    model: str,
    prompt: list[int],
    sampling: Sampling,
    stop: list[str] | None,
) -> ProgressWatch:
    """Submit the request's op with its tokens published as they are chosen; the returned watch
    receives them from the first (`follow` reads it and ends it)."""
    watch = state.notifier.watch_progress(new_request_id())
    try:
        await run_in_threadpool(
            submit_sample, state, principal, model, prompt, sampling, stop, watch.op_id
        )
    except BaseException:
        state.notifier.unwatch_progress(watch)
        raise
    return watch


async def follow(
    state: AppState, principal: Principal, watch: ProgressWatch
) -> AsyncGenerator[Progress | Sampled, None]:
    """The streamed op's progress messages as they arrive, then its result as `wait_for` gives
    it (or raises its failure); the watch ends with the iteration."""
    loop = asyncio.get_running_loop()
    finished = state.notifier.subscribe(watch.op_id)
    try:
        while True:
            finished.clear()
            future = await run_in_threadpool(read_op, state, principal.tenant_id, watch.op_id)
            if future.done:
                break
            recheck_at = loop.time() + _RECHECK_SECONDS
            while not finished.is_set() and (left := recheck_at - loop.time()) > 0:
                progress = await _next_progress(watch, finished, left)
                if progress is not None:
                    yield progress
    finally:
        state.notifier.unsubscribe(watch.op_id, finished)
        state.notifier.unwatch_progress(watch)
    yield _sampled(future)


async def _next_progress(
    watch: ProgressWatch, finished: asyncio.Event, timeout: float
) -> Progress | None:
    """The next progress message; None after `timeout` or once the op is said to be finished."""
    progress = asyncio.ensure_future(watch.next(timeout))
    ended = asyncio.ensure_future(finished.wait())
    try:
        await asyncio.wait({progress, ended}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ended.cancel()
        progress.cancel()
    # A wait cancelled in time leaves its message to the next one; one that already took its
    # message returns it all the same.
    await asyncio.wait({progress})
    return None if progress.cancelled() else progress.result()


def _sampled(future: FutureState) -> Sampled:
    if future.failure is not None:
        failure = future.failure
        if failure.category != "user":
            raise RuntimeError(f"sampling failed on the server: {failure.message}")
        raise InvalidInput(failure.message, code=failure.code)
    assert future.result is not None
    response = (
        decode_sample_response(future.result)
        if future.result_codec == PROTO
        else SampleResponse.model_validate_json(future.result)
    )
    usage = future.usage or {}
    return Sampled(
        response=response,
        prompt_tokens=int(usage.get("sampling_prefill", 0)),
        completion_tokens=int(usage.get("sampling_sample", 0)),
    )
