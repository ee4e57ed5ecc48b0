"""Sampling endpoints: sampling sessions on a base model, saved weights or a live training run's
current weights, and asample."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy.orm import Session as OrmSession

from api.deps import CurrentPrincipal, State
from api.openapi import OP_ERRORS, error_responses
from api.submission import (
    check_base_model,
    in_submission,
    open_live_sampler,
    queue_sample,
    require_session,
)
from billing import estimate
from core import checkpoints, runs
from core.errors import InvalidInput
from core.tables import ModelPackage
from scheduler.convert import DEFAULT_MAX_TOKENS
from scheduler.submit import Submitted
from treadle.types import (
    CreateSamplingSessionRequest,
    CreateSamplingSessionResponse,
    EncodedTextChunk,
    GetSamplerResponse,
    SampleRequest,
    UntypedAPIFuture,
)

router = APIRouter(prefix="/api/v1", tags=["sampling"])

MAX_NUM_SAMPLES = 128


@router.post(
    "/create_sampling_session",
    response_model=CreateSamplingSessionResponse,
    response_model_exclude_none=True,
    responses=error_responses(401, 403, 404, 413, 422),
)
def create_sampling_session(
    body: CreateSamplingSessionRequest, principal: CurrentPrincipal, state: State
) -> CreateSamplingSessionResponse:
    if (body.base_model is None) == (body.model_path is None):
        raise InvalidInput(
            "pass exactly one of base_model (sample the base model) or model_path (a tinker:// "
            "checkpoint, a registry reference, package@alias or package:version, or "
            "live:<training run id> for a run's current weights, to sample from)"
        )
    with state.database.transaction() as db:
        live_run = None if body.model_path is None else runs.live_run_id(body.model_path)
        if live_run is not None:
            sampler = open_live_sampler(
                db,
                state,
                principal,
                session_id=body.session_id,
                seq=body.sampling_session_seq_id,
                run_id=live_run,
            )
            return CreateSamplingSessionResponse(sampling_session_id=sampler.id)
        require_session(db, state, principal, body.session_id)
        version_id, run_id = None, None
        if body.model_path is not None:
            version = checkpoints.resolve(db, state.clock, principal.tenant_id, body.model_path)
            package = db.get(ModelPackage, version.package_id)
            assert package is not None
            base_model, version_id, run_id = package.base_model, version.id, version.training_run_id
        else:
            assert body.base_model is not None
            check_base_model(state, body.base_model)
            base_model = body.base_model
        sampler = runs.create_sampling_session(
            db,
            state.clock,
            tenant_id=principal.tenant_id,
            session_id=body.session_id,
            seq=body.sampling_session_seq_id,
            base_model=base_model,
            model_path=body.model_path,
            training_run_id=run_id,
            model_version_id=version_id,
        )
        return CreateSamplingSessionResponse(sampling_session_id=sampler.id)


@router.get(
    "/samplers/{sampler_id:path}",
    response_model=GetSamplerResponse,
    response_model_exclude_none=True,
    responses=error_responses(401, 403, 404),
)
def get_sampler(sampler_id: str, principal: CurrentPrincipal, state: State) -> GetSamplerResponse:
    with state.database.reader() as db:
        sampler = runs.get_sampling_session(db, principal.tenant_id, sampler_id)
        return GetSamplerResponse(
            sampler_id=sampler.id, base_model=sampler.base_model, model_path=sampler.model_path
        )


@router.post(
    "/asample",
    response_model=UntypedAPIFuture,
    response_model_exclude_none=True,
    responses=OP_ERRORS,
)
def asample(body: SampleRequest, principal: CurrentPrincipal, state: State) -> UntypedAPIFuture:
    if body.sampling_session_id is None:
        raise InvalidInput(
            "asample needs a sampling_session_id; create one with create_sampling_session"
        )
    if not 1 <= body.num_samples <= MAX_NUM_SAMPLES:
        raise InvalidInput(
            f"num_samples {body.num_samples} is outside 1..{MAX_NUM_SAMPLES}; split larger requests"
        )

    sampler_id = body.sampling_session_id
    usage = None
    if principal.spend_limited:
        max_tokens = body.sampling_params.max_tokens
        usage = estimate.sample(
            sum(len(c.tokens) for c in body.prompt.chunks if isinstance(c, EncodedTextChunk)),
            DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
            body.num_samples,
        )

    def work(db: OrmSession) -> tuple[str, Submitted]:
        sampler = runs.get_sampling_session(db, principal.tenant_id, sampler_id)
        return sampler.id, queue_sample(db, state, principal, sampler, body, usage)

    _, submitted = in_submission(state, work)
    return UntypedAPIFuture(
        request_id=submitted.request_id,
        sample_sequence_ids=[f"{submitted.request_id}:{i}" for i in range(body.num_samples)],
    )
