"""Helpers shared by the routes that submit operations."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session as OrmSession

from api import metrics, request_context
from api.deps import AppState
from billing.estimate import Estimate
from billing.ledger import UsageLine
from core import checkpoints, runs, sessions
from core.apikeys import Principal
from core.errors import ErrorCode, InvalidInput, RateLimited, SessionExpired, TreadleError
from core.ids import training_run_id
from core.settings import Mode
from core.tables import ModelVersion, SamplingSession, Tenant, TrainingRun
from scheduler import oplog
from scheduler.admission import admit_training_run
from scheduler.futures import FutureState, read_future
from scheduler.ops import STREAMED, OpKind, encode_json_payload, refused
from scheduler.submit import Submitted, submit, submit_training_op
from treadle.types import SampleRequest, UntypedAPIFuture


def active_run(db: OrmSession, state: AppState, principal: Principal, model_id: str) -> TrainingRun:
    """The caller's training run, if its session is still open (404 otherwise)."""
    run = runs.get_run(db, principal.tenant_id, model_id)
    sessions.require_active(
        db,
        state.clock,
        tenant_id=principal.tenant_id,
        session_id=run.session_id,
        ttl_seconds=state.settings.session_ttl_seconds,
    )
    end = runs.ended(run)
    if end is not None:
        raise InvalidInput(
            f"training run {model_id} {end}; create a new training client (from its last "
            "checkpoint to go on from there)"
        )
    return run


def require_session(db: OrmSession, state: AppState, principal: Principal, session_id: str) -> None:
    sessions.require_active(
        db,
        state.clock,
        tenant_id=principal.tenant_id,
        session_id=session_id,
        ttl_seconds=state.settings.session_ttl_seconds,
    )


def open_live_sampler(
    db: OrmSession, state: AppState, principal: Principal, *, session_id: str, seq: int, run_id: str
) -> SamplingSession:
    """The sampling session `(session_id, seq)` of the caller on the current weights of its
    training run `run_id` (`live:<run id>`): its samples run on the worker holding the run,
    with the adapter as the run's last executed optim_step left it. The caller's session must be
    open; a missing or foreign run is a 404, an unloaded, failed or ended one a user error. A
    retried creation returns the same session."""
    require_session(db, state, principal, session_id)
    run = runs.require_live(db, principal.tenant_id, run_id)
    return runs.create_sampling_session(
        db,
        state.clock,
        tenant_id=principal.tenant_id,
        session_id=session_id,
        seq=seq,
        base_model=run.base_model,
        model_path=runs.LIVE_PREFIX + run.id,
        training_run_id=run.id,
        model_version_id=None,
    )


def read_op(state: AppState, tenant_id: str, request_id: str) -> FutureState:
    """Where the tenant's op `request_id` stands, read as a long-poll re-reads it."""
    with state.database.rows() as db:
        return read_future(
            db, tenant_id, request_id, placed=state.settings.mode is Mode.DISTRIBUTED
        )


def queue_sample(
    db: OrmSession,
    state: AppState,
    principal: Principal,
    sampler: SamplingSession,
    body: SampleRequest,
    usage: tuple[UsageLine, ...] | None,
    *,
    streamed_as: str | None = None,
) -> Submitted:
    """Queue one `sample` op on `sampler` for `/asample` and `/oai/v1` alike. `streamed_as` is
    the op's id, chosen by a caller that watches its progress: the worker then publishes the
    tokens as they are chosen (`Notifier.publish_progress`).

    Access to saved weights can end after the sampling session was created (deleted,
    unpublished), and a live run's weights live only while its session does: both are
    refused here, and the worker checks again before sampling. A full queue is backpressure
    (the tinker SDK waits and resubmits the same seq_id). An unseeded request is given its seed
    here, in the stored payload, so a sample re-run after a worker failure chooses the same
    tokens as the run it replaces (text already streamed stays true).
    """
    require_session(db, state, principal, sampler.session_id)
    if sampler.model_version_id is not None:
        checkpoints.require_sampleable(
            db.get(ModelVersion, sampler.model_version_id),
            principal.tenant_id,
            state.clock,
            sampler.model_path,
        )
    elif runs.is_live(sampler):
        assert sampler.training_run_id is not None
        runs.require_live(db, principal.tenant_id, sampler.training_run_id)
    queued = oplog.queued_samples(db)
    if queued >= state.settings.max_queued_samples:
        raise RateLimited(
            f"the sampling queue is full ({queued} requests waiting); retry shortly",
            retry_after_seconds=1.0,
        )
    params = body.sampling_params
    if params.seed is None:
        # 62 bits, as the engine's own fallback draws.
        params = params.model_copy(update={"seed": secrets.randbits(62)})
    body = body.model_copy(update={"sampling_session_id": sampler.id, "sampling_params": params})
    content = body.model_dump(mode="json", exclude_none=True)
    if streamed_as is not None:
        content[STREAMED] = True
    payload, codec = encode_json_payload(content)
    return submit(
        db,
        state.clock,
        tenant_id=principal.tenant_id,
        session_id=sampler.session_id,
        target_id=sampler.id,
        seq_id=body.seq_id,
        kind=OpKind.SAMPLE,
        payload=payload,
        payload_codec=codec,
        api_key_id=principal.key_id,
        estimate=None if usage is None else Estimate(sampler.base_model, usage),
        op_id=streamed_as,
    )


def check_base_model(state: AppState, base_model: str) -> None:
    if base_model not in state.settings.offered_models:
        raise InvalidInput(
            f"base model {base_model!r} is not served here; use one of {state.settings.offered_models} "
            "(ServiceClient.get_server_capabilities() lists them)",
            code=ErrorCode.UNSUPPORTED,
        )


def check_rank(db: OrmSession, principal: Principal, rank: int) -> None:
    tenant = db.get(Tenant, principal.tenant_id)
    assert tenant is not None
    if not 1 <= rank <= tenant.max_lora_rank:
        raise InvalidInput(
            f"lora rank {rank} is outside 1..{tenant.max_lora_rank} allowed for your account; "
            f"pass a rank from 1 to {tenant.max_lora_rank}"
        )


def open_run(
    db: OrmSession,
    state: AppState,
    principal: Principal,
    *,
    session_id: str,
    model_seq_id: int,
    base_model: str,
    lora_config: dict[str, Any],
    user_metadata: dict[str, Any] | None,
    kind: OpKind,
    payload: dict[str, Any],
) -> tuple[str, Submitted]:
    """Create a training run and submit the op that brings it to life (create_model, or a load),
    as the run's seq 0; returns the run's id and the submitted op (the shape of a `Work`). A retried creation answers with the same run and request, even when the
    tenant's limits would refuse a new run now."""
    require_session(db, state, principal, session_id)
    check_rank(db, principal, runs.lora_rank(lora_config))
    admit_training_run(
        db,
        state.clock,
        tenant_id=principal.tenant_id,
        run_id=training_run_id(session_id, model_seq_id),
        base_model=base_model,
        lora_config=lora_config,
        model_aliases=state.settings.model_aliases,
        session_ttl_seconds=state.settings.session_ttl_seconds,
    )
    run, _ = runs.create_training_run(
        db,
        state.clock,
        tenant_id=principal.tenant_id,
        session_id=session_id,
        model_seq_id=model_seq_id,
        base_model=base_model,
        lora_config=lora_config,
        user_metadata=user_metadata,
    )
    data, codec = encode_json_payload(payload)
    submitted = submit(
        db,
        state.clock,
        tenant_id=principal.tenant_id,
        session_id=session_id,
        target_id=run.id,
        seq_id=0,
        kind=kind,
        payload=data,
        payload_codec=codec,
        api_key_id=principal.key_id,
    )
    return run.id, submitted


Work = Callable[[OrmSession], tuple[str, Submitted]]
"""A route's checks and submit, in the submitting transaction: returns the target's id (a
training run or sampling session) and what was submitted."""


def in_submission(state: AppState, work: Work) -> tuple[str, Submitted]:
    """The one way a route submits an op: `work` runs in one write transaction, the target's
    worker is assigned in it, and woken once it committed."""
    with state.database.transaction() as db:
        target_id, submitted = work(db)
        worker = state.dispatcher.assign(db, target_id)
    metrics.count_submitted(submitted)
    state.dispatcher.wake(worker)
    request_context.note_op(submitted.request_id, target_id)
    return target_id, submitted


Payload = (
    tuple[bytes, str] | dict[str, object] | Callable[[OrmSession, TrainingRun], dict[str, object]]
)
"""An op's payload: stored bytes and their codec, a JSON object, or a function that checks the
request against the run and builds the JSON object."""


def submit_to_run(
    state: AppState,
    principal: Principal,
    model_id: str,
    seq_id: int,
    kind: OpKind,
    payload: Payload,
    usage: tuple[UsageLine, ...] | None = (),
) -> UntypedAPIFuture:
    """Submit an op on the caller's run, in the run's order. If `payload` is a function that
    refuses the request, the op is still queued — it fails through its future in the run's
    order — so the client's next seq_id never waits for one that will not come. `usage` is
    what the op will use (`billing.estimate`; empty for a free op), held against the tenant's
    spend limits when it has any; None (a request refused on its content) and a refused
    `payload` are queued whatever the spend."""
    priced = usage if principal.spend_limited else None

    def work(db: OrmSession) -> tuple[str, Submitted]:
        run = active_run(db, state, principal, model_id)
        estimated = priced
        if isinstance(payload, tuple):
            data, codec = payload
        else:
            try:
                content = payload(db, run) if callable(payload) else payload
            except TreadleError as exc:
                if exc.category != "user" or isinstance(exc, SessionExpired):
                    raise
                content, estimated = refused(exc.message, exc.code), None
            data, codec = encode_json_payload(content)
        return run.id, submit_training_op(
            db,
            state.clock,
            run=run,
            seq_id=seq_id,
            kind=kind,
            payload=data,
            payload_codec=codec,
            api_key_id=principal.key_id,
            usage=estimated,
        )

    _, submitted = in_submission(state, work)
    return UntypedAPIFuture(request_id=submitted.request_id, model_id=model_id)
