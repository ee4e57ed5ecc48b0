"""Saving and loading weights: checkpoints for resuming, for sampling, and for export."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import CurrentPrincipal, State
from api.ops import active_run, check_base_model, check_rank, require_session
from api.routes.training import submit_json_op
from core import checkpoints, runs
from core.errors import InvalidInput
from core.tables import ModelPackage
from scheduler.ops import OpKind, encode_json_payload
from scheduler.submit import submit, submit_training_op
from treadle.types import (
    LoadWeightsRequest,
    SaveWeightsExternalRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    UntypedAPIFuture,
)

router = APIRouter(prefix="/api/v1", tags=["weights"])


def _check_new_checkpoint(state: State, principal: CurrentPrincipal, model_id: str, kind: str,
                          name: str | None, ttl_seconds: int | None, overwrite: bool = False) -> None:
    """Refuse bad names and taken paths at submission, so the error comes back at once."""
    checkpoints.check_ttl(ttl_seconds)
    if name is None:
        return
    checkpoints.check_name(name)
    if not overwrite:
        path = checkpoints.tinker_path(model_id, kind, name)
        with state.database.reader() as db:
            if checkpoints.find_by_path(db, path) is not None:
                raise InvalidInput(f"checkpoint {path} already exists; pick another name or pass overwrite=True")


@router.post("/save_weights", response_model=UntypedAPIFuture, response_model_exclude_none=True)
def save_weights(body: SaveWeightsRequest, principal: CurrentPrincipal, state: State) -> UntypedAPIFuture:
    """Adapter and optimizer state, resumable with load_weights(optimizer=True)."""
    _check_new_checkpoint(state, principal, body.model_id, "training", body.path, body.ttl_seconds, body.overwrite)
    if body.seq_id is None:
        raise InvalidInput("save_weights needs a seq_id: the position of this request in the run's order")
    return submit_json_op(state, principal, body.model_id, body.seq_id, OpKind.SAVE_WEIGHTS,
                          body.model_dump(mode="json", exclude_none=True))


@router.post("/save_weights_for_sampler", response_model=UntypedAPIFuture, response_model_exclude_none=True)
def save_weights_for_sampler(body: SaveWeightsForSamplerRequest, principal: CurrentPrincipal,
                             state: State) -> UntypedAPIFuture:
    """Named: a sampler checkpoint path. Nameless: a new sampling session on these weights."""
    if body.path is None and body.sampling_session_seq_id is None:
        raise InvalidInput("pass a name (path) for a sampler checkpoint, or a sampling_session_seq_id for a "
                           "sampling session on the current weights")
    if body.kind != "snapshot":
        raise InvalidInput(f"sampler kind {body.kind!r} is not supported; use 'snapshot'")
    _check_new_checkpoint(state, principal, body.model_id, "sampler", body.path, body.ttl_seconds)
    if body.seq_id is None:
        raise InvalidInput("save_weights_for_sampler needs a seq_id")
    return submit_json_op(state, principal, body.model_id, body.seq_id, OpKind.SAVE_WEIGHTS_FOR_SAMPLER,
                          body.model_dump(mode="json", exclude_none=True))


@router.post("/save_weights_external", response_model=UntypedAPIFuture, response_model_exclude_none=True)
def save_weights_external(body: SaveWeightsExternalRequest, principal: CurrentPrincipal,
                          state: State) -> UntypedAPIFuture:
    """A PEFT adapter folder, downloadable through external_weights_urls."""
    _check_new_checkpoint(state, principal, body.model_id, "external", body.path, body.ttl_seconds)
    if body.age_encryption_recipients:
        raise InvalidInput("age encryption of exports is not supported; omit age_encryption_recipients")
    if body.seq_id is None:
        raise InvalidInput("save_weights_external needs a seq_id")
    return submit_json_op(state, principal, body.model_id, body.seq_id, OpKind.SAVE_WEIGHTS_EXTERNAL,
                          body.model_dump(mode="json", exclude_none=True))


@router.post("/load_weights", response_model=UntypedAPIFuture, response_model_exclude_none=True)
def load_weights(body: LoadWeightsRequest, principal: CurrentPrincipal, state: State) -> UntypedAPIFuture:
    """Either create a run from a checkpoint (session_id + model_seq_id), or load into a run."""
    with state.database.transaction() as db:
        version = checkpoints.resolve(db, state.clock, principal.tenant_id, body.path)
        package = db.get(ModelPackage, version.package_id)
        assert package is not None
        if body.optimizer and version.kind != "training":
            raise InvalidInput(f"{body.path} holds no optimizer state; save with save_state to resume with the "
                               "optimizer, or load without it")
        payload = {"artifact_uri": version.artifact_uri, "path": body.path, "optimizer": body.optimizer,
                   "base_model": package.base_model}
        if body.model_id is not None:
            run = active_run(db, state, principal, body.model_id)
            if run.base_model != package.base_model:
                raise InvalidInput(f"{body.path} was trained on {package.base_model}, but {run.id} uses "
                                   f"{run.base_model}; load it into a run on {package.base_model}")
            if body.seq_id is None:
                raise InvalidInput("load_weights into an existing run needs a seq_id")
            data, codec = encode_json_payload(payload)
            submitted = submit_training_op(db, state.clock, run=run, seq_id=body.seq_id,
                                           kind=OpKind.LOAD_WEIGHTS, payload=data, payload_codec=codec)
            run_id = run.id
        else:
            assert body.session_id is not None and body.model_seq_id is not None
            if body.base_model is not None and body.base_model != package.base_model:
                raise InvalidInput(f"{body.path} was trained on {package.base_model}, not {body.base_model}")
            check_base_model(state, package.base_model)
            require_session(db, state, principal, body.session_id)
            lora = dict(version.lora_config or {"rank": 32})
            check_rank(db, principal, int(lora.get("rank", 32)))
            run, _ = runs.create_training_run(
                db, state.clock, tenant_id=principal.tenant_id, session_id=body.session_id,
                model_seq_id=body.model_seq_id, base_model=package.base_model, lora_config=lora,
                user_metadata=body.user_metadata,
            )
            data, codec = encode_json_payload(payload)
            submitted = submit(db, state.clock, tenant_id=principal.tenant_id, session_id=body.session_id,
                               target_id=run.id, seq_id=0, kind=OpKind.LOAD_WEIGHTS, payload=data,
                               payload_codec=codec)
            run_id = run.id
    state.dispatcher.wake(run_id)
    return UntypedAPIFuture(request_id=submitted.request_id, model_id=run_id)
