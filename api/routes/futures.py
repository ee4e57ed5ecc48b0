"""Futures: long-polled results of submitted operations."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from api.deps import CurrentPrincipal, State
from api.openapi import error_responses
from api.submission import read_op
from scheduler.futures import FutureState
from scheduler.ops import PROTO
from treadle.types import (
    CancelFutureRequest,
    FutureError,
    RetrieveFutureRequest,
    TryAgainResponse,
)
from treadle.wire import (
    PROTOBUF_CONTENT_TYPE,
    decode_forward_backward_output,
    decode_sample_response,
)

router = APIRouter(prefix="/api/v1", tags=["futures"])

USAGE_HEADER = "X-Treadle-Usage"
"""On a successful result: the op's billed quantities as compact JSON, kind -> quantity, and
`cost_micros`, what they cost in micro-units (absent when the op bills nothing)."""

# Between wake-ups the database is re-read at this interval, so a lost notification costs little.
_RECHECK_SECONDS = 1.0


def _proto_as_json(result: bytes, request_type: str | None) -> bytes:
    # Dumped by the wire types, which write NaN and infinities (logprobs often hold them) as
    # "NaN" / "Infinity" / "-Infinity"; plain JSON encoding has no spelling for them.
    if request_type == "Sample":
        return decode_sample_response(result).model_dump_json().encode()
    try:
        return decode_forward_backward_output(result).model_dump_json().encode()
    except ValueError:
        return decode_sample_response(result).model_dump_json().encode()


def _respond(state: FutureState, request: Request) -> Response:
    if state.failure is not None:
        # `error` and `category` are what the tinker SDK reads; `code` is for programs.
        failure = state.failure
        return JSONResponse(
            FutureError(
                error=failure.message, category=failure.category, code=failure.code.value
            ).model_dump(mode="json")
        )
    response = _result(state, request)
    if state.usage is not None:
        response.headers[USAGE_HEADER] = json.dumps(
            state.usage, separators=(",", ":"), sort_keys=True
        )
    return response


def _result(state: FutureState, request: Request) -> Response:
    assert state.result is not None
    if state.result_codec == PROTO:
        if PROTOBUF_CONTENT_TYPE in request.headers.get("accept", ""):
            return Response(state.result, media_type=PROTOBUF_CONTENT_TYPE)
        return Response(
            _proto_as_json(state.result, request.headers.get("x-tinker-request-type")),
            media_type="application/json",
        )
    return Response(state.result, media_type="application/json")


@router.post(
    "/retrieve_future",
    response_model=None,
    responses={
        200: {
            "description": "The result (JSON, or protobuf when accepted), `try_again`, or the "
            "operation's error `{error, category, code}`.",
            "content": {
                "application/json": {"schema": {}},
                PROTOBUF_CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}},
            },
        },
        **error_responses(401, 403, 404, 413, 422),
    },
)
async def retrieve_future(
    body: RetrieveFutureRequest, request: Request, principal: CurrentPrincipal, state: State
) -> Response:
    """Holds the request until the result exists or the long-poll window ends (then `try_again`)."""
    deadline = time.monotonic() + state.settings.long_poll_seconds
    event = state.notifier.subscribe(body.request_id)
    try:
        while True:
            future = await run_in_threadpool(read_op, state, principal.tenant_id, body.request_id)
            if future.done:
                return _respond(future, request)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return JSONResponse(
                    TryAgainResponse(
                        request_id=body.request_id, queue_state=future.queue_state
                    ).model_dump(mode="json", exclude_none=True)
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), min(remaining, _RECHECK_SECONDS))
            event.clear()
    finally:
        state.notifier.unsubscribe(body.request_id, event)


@router.post("/cancel_future", responses=error_responses(401, 403, 413, 422))
def cancel_future(body: CancelFutureRequest, principal: CurrentPrincipal) -> dict[str, str]:
    """Accepted; an operation already queued still runs (its result is simply not fetched)."""
    return {"status": "accepted"}
