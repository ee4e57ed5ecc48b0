"""Saving and loading weights: checkpoints for resuming, for sampling, and for export."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter
from sqlalchemy.orm import Session as OrmSession

from api.deps import CurrentPrincipal, State
from api.openapi import OP_ERRORS
from api.submission import check_base_model, in_submission, open_run, submit_to_run
from billing import estimate
from core import checkpoints, runs
from core.errors import ErrorCode, InvalidInput
from core.tables import ModelPackage, ModelVersion, TrainingRun
from scheduler.ops import OpKind
from scheduler.submit import Submitted
from treadle.types import (
    LoadWeightsRequest,
    SaveWeightsExternalRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    UntypedAPIFuture,
)

router = APIRouter(prefix="/api/v1", tags=["weights"])


def _new_checkpoint(
    body: SaveWeightsRequest | SaveWeightsForSamplerRequest | SaveWeightsExternalRequest,
    kind: str,
    overwrite: bool = False,
) -> Callable[[OrmSession, TrainingRun], dict[str, object]]:
    """The op's payload, once the name, TTL and path are acceptable. A refusal still takes the
    request's place in the run's order and fails through its future (see submit_to_run)."""

    def payload(db: OrmSession, run: TrainingRun) -> dict[str, object]:
        checkpoints.check_ttl(body.ttl_seconds)
        if body.path is not None:
            checkpoints.check_name(body.path)
            path = checkpoints.tinker_path(run.id, kind, body.path)
            existing = checkpoints.find_by_path(db, path)
            if existing is not None and not overwrite:
                raise InvalidInput(
                    f"checkpoint {path} already exists; pick another name or pass overwrite=True"
                )
            if existing is not None:
                checkpoints.require_unaliased(db, existing, "overwrite")
        return body.model_dump(mode="json", exclude_none=True)

    return payload


def _seq_id(seq_id: int | None, endpoint: str) -> int:
    if seq_id is None:
        raise InvalidInput(
            f"{endpoint} needs a seq_id: the position of this request in the run's order"
        )
    return seq_id


@router.post(
    "/save_weights",
    response_model=UntypedAPIFuture,
    response_model_exclude_none=True,
    responses=OP_ERRORS,
)
def save_weights(
    body: SaveWeightsRequest, principal: CurrentPrincipal, state: State
) -> UntypedAPIFuture:
    """Adapter and optimizer state, resumable with load_weights(optimizer=True)."""
    return submit_to_run(
        state,
        principal,
        body.model_id,
        _seq_id(body.seq_id, "save_weights"),
        OpKind.SAVE_WEIGHTS,
        _new_checkpoint(body, "training", body.overwrite),
        usage=estimate.checkpoint(),
    )


@router.post(
    "/save_weights_for_sampler",
    response_model=UntypedAPIFuture,
    response_model_exclude_none=True,
    responses=OP_ERRORS,
)
def save_weights_for_sampler(
    body: SaveWeightsForSamplerRequest, principal: CurrentPrincipal, state: State
) -> UntypedAPIFuture:
    """Named: a sampler checkpoint path. Nameless: a new sampling session on these weights."""
    check_name_and_ttl = _new_checkpoint(body, "sampler")

    def payload(db: OrmSession, run: TrainingRun) -> dict[str, object]:
        if body.path is None and body.sampling_session_seq_id is None:
            raise InvalidInput(
                "pass a name (path) for a sampler checkpoint, or a sampling_session_seq_id for "
                "a sampling session on the current weights"
            )
        if body.kind != "snapshot":
            raise InvalidInput(
                f"sampler kind {body.kind!r} is not supported; use 'snapshot'",
                code=ErrorCode.UNSUPPORTED,
            )
        return check_name_and_ttl(db, run)

    return submit_to_run(
        state,
        principal,
        body.model_id,
        _seq_id(body.seq_id, "save_weights_for_sampler"),
        OpKind.SAVE_WEIGHTS_FOR_SAMPLER,
        payload,
        usage=estimate.checkpoint(),
    )


@router.post(
    "/save_weights_external",
    response_model=UntypedAPIFuture,
    response_model_exclude_none=True,
    responses=OP_ERRORS,
)
def save_weights_external(
    body: SaveWeightsExternalRequest, principal: CurrentPrincipal, state: State
) -> UntypedAPIFuture:
    """A PEFT adapter folder, downloadable through external_weights_urls."""
    check_name_and_ttl = _new_checkpoint(body, "external")

    def payload(db: OrmSession, run: TrainingRun) -> dict[str, object]:
        if body.age_encryption_recipients:
            raise InvalidInput(
                "age encryption of exports is not supported; omit age_encryption_recipients",
                code=ErrorCode.UNSUPPORTED,
            )
        return check_name_and_ttl(db, run)

    return submit_to_run(
        state,
        principal,
        body.model_id,
        _seq_id(body.seq_id, "save_weights_external"),
        OpKind.SAVE_WEIGHTS_EXTERNAL,
        payload,
        usage=estimate.checkpoint(),
    )


def _loadable(
    db: OrmSession, state: State, principal: CurrentPrincipal, body: LoadWeightsRequest
) -> tuple[ModelVersion, str]:
    """The checkpoint to load and its base model, if the caller may load it as asked."""
    version = checkpoints.resolve(db, state.clock, principal.tenant_id, body.path)
    package = db.get(ModelPackage, version.package_id)
    assert package is not None
    if body.optimizer and version.kind != "training":
        raise InvalidInput(
            f"{body.path} holds no optimizer state; save with save_state to resume with the "
            "optimizer, or load without it"
        )
    return version, package.base_model


def _load_payload(
    version: ModelVersion, base_model: str, body: LoadWeightsRequest
) -> dict[str, object]:
    return {
        "artifact_uri": version.artifact_uri,
        # The version resolved now: a reference may point elsewhere by the time the op runs.
        "version_id": version.id,
        "path": body.path,
        "optimizer": body.optimizer,
        "base_model": base_model,
    }


@router.post(
    "/load_weights",
    response_model=UntypedAPIFuture,
    response_model_exclude_none=True,
    responses=OP_ERRORS,
)
def load_weights(
    body: LoadWeightsRequest, principal: CurrentPrincipal, state: State
) -> UntypedAPIFuture:
    """Either create a run from a checkpoint (session_id + model_seq_id), or load into a run."""
    if body.model_id is not None:

        def payload(db: OrmSession, run: TrainingRun) -> dict[str, object]:
            version, base_model = _loadable(db, state, principal, body)
            if run.base_model != base_model:
                raise InvalidInput(
                    f"{body.path} was trained on {base_model}, but {run.id} uses "
                    f"{run.base_model}; load it into a run on {base_model}"
                )
            return _load_payload(version, base_model, body)

        return submit_to_run(
            state,
            principal,
            body.model_id,
            _seq_id(body.seq_id, "load_weights"),
            OpKind.LOAD_WEIGHTS,
            payload,
        )

    assert body.session_id is not None and body.model_seq_id is not None

    def work(db: OrmSession) -> tuple[str, Submitted]:
        version, base_model = _loadable(db, state, principal, body)
        if body.base_model is not None and body.base_model != base_model:
            raise InvalidInput(f"{body.path} was trained on {base_model}, not {body.base_model}")
        check_base_model(state, base_model)
        assert body.session_id is not None and body.model_seq_id is not None
        return open_run(
            db,
            state,
            principal,
            session_id=body.session_id,
            model_seq_id=body.model_seq_id,
            base_model=base_model,
            lora_config=dict(version.lora_config or {"rank": runs.DEFAULT_LORA_RANK}),
            user_metadata=body.user_metadata,
            kind=OpKind.LOAD_WEIGHTS,
            payload=_load_payload(version, base_model, body),
        )

    run_id, submitted = in_submission(state, work)
    return UntypedAPIFuture(request_id=submitted.request_id, model_id=run_id)
