"""What the access line (`api.request_log`) says of a request that only the route learns: the
tenant its key belongs to, and the op it queued with that op's target.

The middleware opens a `RequestFacts` for each HTTP request; authentication and submission
note into it through `note_tenant` and `note_op`, from the event loop or from a worker thread
(which runs in a copy of the request's context, holding the same object). Outside a request
(a test calling a dependency directly, the admin commands) the notes are dropped. Nothing of
an API key is ever noted, only the tenant it resolved to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import uuid
from collections.abc import Iterator, MutableMapping
from contextvars import ContextVar
from typing import Any

HEADER = "X-Request-Id"
# What a client's X-Request-Id may hold to be logged and echoed as it is.
_VALID_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# Where the request's id is kept in its ASGI scope for the answer to an unexpected fault, which
# Starlette makes outside every middleware (`api.errors`).
_SCOPE_KEY = "treadle.request_id"


@dataclasses.dataclass
class RequestFacts:
    """What the line says of a request beyond its method, route, status and duration."""

    request_id: str
    tenant_id: str | None = None
    op_id: str | None = None
    target_id: str | None = None


_current: ContextVar[RequestFacts | None] = ContextVar("treadle_request", default=None)


def request_id_of(sent: str | None) -> str:
    """The client's request id when it is at most 128 characters of letters, digits and
    `._:-`, else a new one."""
    if sent is not None and _VALID_ID.fullmatch(sent):
        return sent
    return uuid.uuid4().hex


@contextlib.contextmanager
def opened(facts: RequestFacts, scope: MutableMapping[str, Any]) -> Iterator[RequestFacts]:
    """Notes made while this is open go to `facts`; the request's `scope` keeps its id."""
    scope[_SCOPE_KEY] = facts.request_id
    token = _current.set(facts)
    try:
        yield facts
    finally:
        _current.reset(token)


def note_tenant(tenant_id: str) -> None:
    """The request was authenticated as a key of `tenant_id`."""
    facts = _current.get()
    if facts is not None:
        facts.tenant_id = tenant_id


def note_op(op_id: str, target_id: str) -> None:
    """The request queued (or, resubmitted, was answered with) op `op_id` on `target_id`: a
    training run (its model_id) or a sampling session."""
    facts = _current.get()
    if facts is not None:
        facts.op_id, facts.target_id = op_id, target_id


def request_id_in(scope: MutableMapping[str, Any]) -> str | None:
    """The id of the request `scope` belongs to; None before the middleware gave it one."""
    kept = scope.get(_SCOPE_KEY)
    return kept if isinstance(kept, str) else None
