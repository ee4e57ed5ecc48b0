"""Session search (`POST /sessions/search`, experimental in the tinker SDK).

Requests filter by id, display name, metadata, owner and status; results come newest first
with a keyset cursor.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal, TypeAlias

from pydantic import AwareDatetime, Field

from treadle.types._base import WireRequest, WireResponse

ClientFinishReasonType: TypeAlias = Literal["success", "errored", "interrupted"]


class OwnSearchOwner(WireRequest):
    type: Literal["own"] = "own"


class AccessibleSearchOwner(WireRequest):
    type: Literal["accessible"] = "accessible"


class UserSearchOwner(WireRequest):
    type: Literal["user"] = "user"
    owner_urns: list[str] = Field(min_length=1, max_length=10)


SearchOwner: TypeAlias = Annotated[
    OwnSearchOwner | AccessibleSearchOwner | UserSearchOwner, Field(discriminator="type")
]


class ActiveSessionStatusQuery(WireRequest):
    type: Literal["active"] = "active"


class CancelledSessionStatusQuery(WireRequest):
    type: Literal["cancelled"] = "cancelled"


class FailedSessionStatusQuery(WireRequest):
    type: Literal["failed"] = "failed"


class ClientFinishedSessionStatusQuery(WireRequest):
    type: Literal["client_finished"] = "client_finished"
    reasons: list[ClientFinishReasonType] | None = Field(default=None, min_length=1)


SessionStatusQuery: TypeAlias = Annotated[
    ActiveSessionStatusQuery
    | CancelledSessionStatusQuery
    | FailedSessionStatusQuery
    | ClientFinishedSessionStatusQuery,
    Field(discriminator="type"),
]


class SessionSearchCursor(WireResponse):
    last_created_at: AwareDatetime
    last_session_id: str


class SessionSearchRequest(WireRequest):
    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = Field(default_factory=dict)
    display_name: str | None = Field(default=None, min_length=1)
    owner: SearchOwner = Field(default_factory=OwnSearchOwner)
    statuses: list[SessionStatusQuery] | None = Field(default=None, min_length=1)
    limit: int = Field(default=50, ge=1, le=200)
    cursor: SessionSearchCursor | None = None


class SessionFailedReason(WireResponse):
    """What failed a session: `request`, `training_run` or `sampling_session`, with its id."""

    type: Literal["request", "training_run", "sampling_session"]
    request_id: str | None = None
    request_type: str | None = None
    training_run_id: str | None = None
    sampling_session_id: str | None = None


class SessionFailed(WireResponse):
    type: Literal["failed"] = "failed"
    category: Literal["user", "internal"]
    reason: SessionFailedReason
    message: str


class SessionCancelled(WireResponse):
    type: Literal["cancelled"] = "cancelled"
    detail: str | None = None


class ClientFinishReason(WireResponse):
    type: ClientFinishReasonType


class ClientSessionFinished(WireResponse):
    type: Literal["client_finished"] = "client_finished"
    reason: ClientFinishReason
    detail: str | None = None


class SessionActive(WireResponse):
    type: Literal["active"] = "active"


SessionStatus: TypeAlias = Annotated[
    SessionFailed | SessionCancelled | ClientSessionFinished | SessionActive,
    Field(discriminator="type"),
]


class SessionSummary(WireResponse):
    session_id: str
    created_at: datetime
    owner: str
    project_id: str
    status: SessionStatus | None = None
    checkpoints_count: int
    display_name: str | None = None
    user_metadata: dict[str, str] | None = None
    checkpoint_storage_bytes: int | None = None


class SessionSearchResponse(WireResponse):
    sessions: list[SessionSummary]
    next_cursor: SessionSearchCursor | None = None
