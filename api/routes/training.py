"""Training endpoints: create a LoRA run, get its info, forward/backward, optimizer steps."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import ValidationError
from sqlalchemy.orm import Session as OrmSession
from starlette.concurrency import run_in_threadpool

from api.deps import CurrentPrincipal, State
from api.openapi import OP_ERRORS, error_responses, raw_request_body
from api.submission import check_base_model, in_submission, open_run, submit_to_run
from api.validation import clip, describe
from billing import estimate
from core import runs
from core.errors import ErrorCode, InvalidInput, PayloadTooLarge
from core.tables import TrainingRun
from scheduler import fb_proto
from scheduler.convert import check_request_shapes
from scheduler.fb_proto import Submission
from scheduler.oplog import UNLOAD_SEQ
from scheduler.ops import OpKind, encode_json_payload, encode_proto_payload, refused
from scheduler.submit import Submitted
from treadle.types import (
    CreateModelRequest,
    ForwardBackwardRequest,
    GetInfoRequest,
    GetInfoResponse,
    ModelData,
    OptimStepRequest,
    UnloadModelRequest,
    UntypedAPIFuture,
)
from treadle.wire import (
    PROTOBUF_CONTENT_TYPE,
    BodyTooLarge,
    WireFormatError,
    encode_forward_backward_request,
)

router = APIRouter(prefix="/api/v1", tags=["training"])


@router.post(
    "/create_model",
    response_model=UntypedAPIFuture,
    response_model_exclude_none=True,
    responses=OP_ERRORS,
)
def create_model(
    body: CreateModelRequest, principal: CurrentPrincipal, state: State
) -> UntypedAPIFuture:
    check_base_model(state, body.base_model)
    if body.optimizer_config.type != "adamw":
        raise InvalidInput(
            f"optimizer {body.optimizer_config.type!r} is not supported; use adamw",
            code=ErrorCode.UNSUPPORTED,
        )
    lora = body.lora_config.model_dump() if body.lora_config else {"rank": runs.DEFAULT_LORA_RANK}

    def work(db: OrmSession) -> tuple[str, Submitted]:
        return open_run(
            db,
            state,
            principal,
            session_id=body.session_id,
            model_seq_id=body.model_seq_id,
            base_model=body.base_model,
            lora_config=lora,
            user_metadata=body.user_metadata,
            kind=OpKind.CREATE_MODEL,
            payload={"base_model": body.base_model, "lora_config": lora},
        )

    run_id, submitted = in_submission(state, work)
    return UntypedAPIFuture(request_id=submitted.request_id, model_id=run_id)


@router.post(
    "/get_info",
    response_model=GetInfoResponse,
    response_model_exclude_none=True,
    responses=error_responses(401, 403, 404, 413, 422),
)
def get_info(body: GetInfoRequest, principal: CurrentPrincipal, state: State) -> GetInfoResponse:
    with state.database.reader() as db:
        run = runs.get_run(db, principal.tenant_id, body.model_id)
        return GetInfoResponse(
            model_id=run.id,
            model_data=ModelData(
                arch="llama", model_name=run.base_model, tokenizer_id=run.base_model
            ),
            is_lora=True,
            lora_rank=run.lora_rank,
            model_name=run.base_model,
        )


def _decode_forward_backward(
    body: bytes, content_type: str, content_encoding: str | None, max_bytes: int
) -> tuple[Submission, bytes, str, int | None]:
    """What queues the op, the payload to store: the protobuf as sent (zstd-compressed
    unless it came compressed), or the refusal of loss inputs that do not fit their datums;
    and the tokens the request trains (None for a refusal, which trains nothing).

    A protobuf body is parsed, but no value in it becomes a Python object here: the checks
    read byte lengths, shapes and (for CSR tensors) index arrays through numpy. A compressed
    body may expand to at most `max_bytes` (the request size limit), checked while it is
    decompressed.
    """
    refusal: InvalidInput | None = None
    try:
        if "json" in content_type:
            request = ForwardBackwardRequest.model_validate_json(body)
            submission = Submission(request.model_id, request.seq_id, request.forward_only)
            payload = encode_forward_backward_request(request, compress=True)
            try:
                check_request_shapes(request)
            except InvalidInput as exc:
                refusal = exc
            else:
                tokens = sum(datum.model_input.length for datum in request.data)
                return submission, payload, "proto+zstd", tokens
        else:
            msg = fb_proto.read(body, content_encoding, max_bytes)
            submission = fb_proto.submission(msg)
            try:
                tokens = fb_proto.check_request_shapes(msg)
            except InvalidInput as exc:
                refusal = exc
    except BodyTooLarge as exc:
        raise PayloadTooLarge(str(exc)) from exc
    except WireFormatError as exc:
        raise InvalidInput(str(exc)) from exc
    except ValidationError as exc:  # pydantic validation of a JSON body or a header field
        # Bounded like every validation error: a body of many bad datums lists a few of them.
        raise InvalidInput(describe(exc.errors(), "forward_backward request")[0]) from exc
    except ValueError as exc:
        raise InvalidInput(f"invalid forward_backward request: {clip(str(exc), 1000)}") from exc
    if refusal is not None:
        # Loss inputs the engine could not even lay out never reach it: the request keeps its
        # place in the run's order and fails there, like any request refused on its content.
        # forward_only is kept so that a refused forward pass never fails an optim_step.
        content, codec = encode_json_payload(
            {**refused(refusal.message, refusal.code), "forward_only": submission.forward_only}
        )
        return submission, content, codec, None
    if content_encoding in ("zstd", "gzip"):
        return submission, body, f"proto+{content_encoding}", tokens
    payload, codec = encode_proto_payload(body)
    return submission, payload, codec, tokens


@router.post(
    "/forward_backward",
    response_model=UntypedAPIFuture,
    response_model_exclude_none=True,
    responses=OP_ERRORS,
    openapi_extra=raw_request_body(
        json_schema=ForwardBackwardRequest,
        binary_media_types=(PROTOBUF_CONTENT_TYPE,),
        description="Protobuf (as the tinker SDK sends it; `Content-Encoding: zstd` or `gzip` "
        "allowed), or JSON for clients without protobuf.",
    ),
)
async def forward_backward(
    request: Request, principal: CurrentPrincipal, state: State
) -> UntypedAPIFuture:
    """Protobuf body (as the tinker SDK sends it), or JSON for clients without protobuf."""
    body = await request.body()
    decoded, payload, codec, tokens = await run_in_threadpool(
        _decode_forward_backward,
        body,
        request.headers.get("content-type", ""),
        request.headers.get("content-encoding"),
        state.settings.max_request_bytes,
    )
    return await run_in_threadpool(
        submit_to_run,
        state,
        principal,
        decoded.model_id,
        decoded.seq_id,
        OpKind.FORWARD_BACKWARD,
        (payload, codec),
        None if tokens is None else estimate.training(tokens),
    )


@router.post(
    "/optim_step",
    response_model=UntypedAPIFuture,
    response_model_exclude_none=True,
    responses=OP_ERRORS,
)
def optim_step(
    body: OptimStepRequest, principal: CurrentPrincipal, state: State
) -> UntypedAPIFuture:
    if body.seq_id is None:
        raise InvalidInput(
            "optim_step needs a seq_id: the position of this request in the run's order"
        )

    def payload(db: OrmSession, run: TrainingRun) -> dict[str, object]:
        if body.optimizer_params is not None:
            raise InvalidInput(
                "only AdamW is supported; send adam_params instead of optimizer_params"
            )
        return body.model_dump(mode="json", exclude_none=True)

    return submit_to_run(state, principal, body.model_id, body.seq_id, OpKind.OPTIM_STEP, payload)


@router.post(
    "/unload_model",
    response_model=UntypedAPIFuture,
    response_model_exclude_none=True,
    responses=OP_ERRORS,
)
def unload_model(
    body: UnloadModelRequest, principal: CurrentPrincipal, state: State
) -> UntypedAPIFuture:
    """Frees the run's memory once every request submitted before it has run."""
    return submit_to_run(state, principal, body.model_id, UNLOAD_SEQ, OpKind.UNLOAD_MODEL, {})
