"""Wire types of the Tinker billing and audit endpoints: hourly usage buckets
(`GET /api/v1/billing/usage/events`), current checkpoint storage
(`GET /api/v1/billing/usage/checkpoints/current`) and the audit log (`GET /api/v1/audit`).

Field names and shapes follow the tinker SDK's `BillingUsageResponse`,
`CurrentCheckpointStorageUsageResponse` and `AuditLogResponse`, so its `AdminClient` and
`tinker billing` CLI read them. Costs here are Treadle's own ledger amounts, converted to
dollars (the ledger keeps integer micro-units).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import Field

from treadle.types._base import WireResponse

MAX_USAGE_WINDOW_DAYS = 14
"""The longest window one usage request may cover (the tinker SDK's documented bound)."""

STORAGE_HOURS_PER_MONTH = 720
"""The month the tinker SDK's storage rates are quoted over (`gigabyte_hours / 720`)."""

AuditEventType = Literal["all", "checkpoints", "projects", "teams", "organizations"]


class TrainingBillingEvent(WireResponse):
    type: Literal["training"] = "training"
    token_count: int


class SamplingPrefillBillingEvent(WireResponse):
    type: Literal["sampling_prefill"] = "sampling_prefill"
    cached: bool
    """True for the bucket's prompt tokens served from the prefill cache (the cached rate)."""
    token_count: int


class SamplingSampleBillingEvent(WireResponse):
    type: Literal["sampling_sample"] = "sampling_sample"
    token_count: int


class CheckpointBillingEvent(WireResponse):
    type: Literal["checkpoint"] = "checkpoint"
    count: int


class StorageBillingEvent(WireResponse):
    type: Literal["storage"] = "storage"
    free: bool = False
    gigabyte_hours: float


BillingEventInfo = Annotated[
    TrainingBillingEvent
    | SamplingPrefillBillingEvent
    | SamplingSampleBillingEvent
    | CheckpointBillingEvent
    | StorageBillingEvent,
    Field(discriminator="type"),
]


class BillingUsageEvent(WireResponse):
    """One UTC hour of one kind of usage on one base model in one session."""

    bucket_start: datetime
    bucket_end: datetime
    base_model: str | None = None
    """None for storage, which is metered per tenant across base models."""
    user_id: str | None = None
    """The API key that created the session (Treadle has no users; keys stand for them)."""
    user_name: str | None = None
    session_id: str | None = None
    project_id: str | None = None
    estimated_cost_usd: float | None = None
    """The ledger's amount for the bucket, in dollars; None when the usage had no price."""
    effective_rate_usd_per_million_tokens: float | None = None
    effective_rate_usd_per_gigabyte_month: float | None = None
    """Per 720-hour month, as the tinker SDK quotes it."""
    amount_micros: int = 0
    """The exact amount charged for the bucket, in micro-units (a Treadle extension)."""
    event_info: BillingEventInfo


class BillingUsageSession(WireResponse):
    user_metadata: dict[str, str] | None = None


class BillingUsageResponse(WireResponse):
    data: list[BillingUsageEvent]
    """Ordered by bucket, then by quantity, largest first."""
    sessions: dict[str, BillingUsageSession] = Field(default_factory=dict)
    cost_data_through: datetime | None = None
    """Always None: every cost comes from Treadle's price book, none from an invoice."""


class CurrentCheckpointStorageUsageItem(WireResponse):
    project_id: str | None = None
    org_user_urn: str | None = None
    user_email: str | None = None
    user_name: str | None = None
    checkpoint_count: int
    size_bytes: int
    size_gigabytes: float
    estimated_monthly_cost_usd: float | None = None
    """A 720-hour month at the current storage rate; None when storage has no price."""


class CurrentCheckpointStorageUsageResponse(WireResponse):
    effective_rate_usd_per_gigabyte_month: float | None = None
    data: list[CurrentCheckpointStorageUsageItem]


class AuditLogEntry(WireResponse):
    timestamp: datetime
    event: str
    """`<resource>_<action>`, e.g. `checkpoint_published`, `api_key_revoked`."""
    event_details: dict[str, Any] = Field(default_factory=dict)
    """`actor` (an API key id, or "operator"), `target`, and what the change was."""
    model_id: str | None = None
    tinker_path: str | None = None
    purpose: str | None = None


class AuditLogResponse(WireResponse):
    entries: list[AuditLogEntry]
    """Oldest first."""
