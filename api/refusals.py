"""A training request refused at the API still takes its place in its run's order.

Clients number a run's requests and send the next one without waiting (the tinker SDK does),
so a refused request whose seq_id the server never records leaves a gap: every later request
of the run would wait out `TREADLE_GAP_TIMEOUT_SECONDS`. When a refused request names a run of
the caller and a seq_id in range, the refusal is queued under that seq_id instead, and fails in
order through its own operation. The client has its answer at once (the 4xx); the run goes on.
"""

from __future__ import annotations

import logging
from typing import Any

from api.deps import AppState
from api.submission import submit_to_run
from core import apikeys
from core.errors import ErrorCode, TreadleError
from scheduler.ops import OpKind, refused
from treadle.types.bounds import MAX_SEQ_ID

log = logging.getLogger(__name__)

# The routes whose requests take a place in a run's order, by path.
ORDERED_ROUTES = {
    "/api/v1/forward_backward": OpKind.FORWARD_BACKWARD,
    "/api/v1/optim_step": OpKind.OPTIM_STEP,
    "/api/v1/save_weights": OpKind.SAVE_WEIGHTS,
    "/api/v1/save_weights_for_sampler": OpKind.SAVE_WEIGHTS_FOR_SAMPLER,
    "/api/v1/save_weights_external": OpKind.SAVE_WEIGHTS_EXTERNAL,
    "/api/v1/load_weights": OpKind.LOAD_WEIGHTS,
}


def keep_place(state: AppState, path: str, api_key: str | None, body: Any, message: str) -> None:
    """Queue `message` as the refusal at the request's place in its run, if it has one.

    Best effort: a request without a readable run and seq_id, from an unknown key, or for a
    run that is not the caller's or not open, has no place to keep, and the 4xx alone answers.
    """
    kind = ORDERED_ROUTES.get(path)
    if kind is None or not isinstance(body, dict):
        return
    model_id, seq_id = body.get("model_id"), body.get("seq_id")
    if not isinstance(model_id, str) or type(seq_id) is not int or not 1 <= seq_id <= MAX_SEQ_ID:
        return
    try:
        with state.database.rows() as db:
            principal = apikeys.authenticate(db, state.clock, state.server_secret, api_key)
        # A refused forward pass (forward_only) must not fail the run's next optim_step.
        content = {
            **refused(message, ErrorCode.INVALID_INPUT),
            "forward_only": body.get("forward_only") is True,
        }
        submit_to_run(state, principal, model_id, seq_id, kind, content, usage=None)
    except TreadleError:
        return
    log.info(
        "refused %s seq %d of %s at the API; its place in the order is kept", kind, seq_id, model_id
    )
