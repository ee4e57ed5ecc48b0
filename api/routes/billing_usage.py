"""The tenant's billing usage as the tinker SDK's `AdminClient` and `tinker billing` CLI read
it: hourly usage buckets with their cost, and the checkpoint storage held now.

Costs are the ledger's amounts (integer micro-units) in dollars; rates are the price book's
versions the usage was charged at. The tinker SDK quotes storage per 720-hour month while
Treadle's price book uses 730 hours (`billing.prices`), so storage rates are converted to keep
the SDK's `rate * gigabyte_hours / 720` equal to what was charged.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fastapi import APIRouter, Query

from api.deps import CurrentPrincipal, ReadSession, State
from api.openapi import error_responses
from api.views import string_metadata
from billing import reports
from billing.prices import ANY_MODEL, BYTES_PER_GB, HOURS_PER_MONTH, Rate, rate_in_force
from core.errors import InvalidInput
from treadle.types import (
    BillingEventInfo,
    BillingUsageEvent,
    BillingUsageResponse,
    BillingUsageSession,
    CheckpointBillingEvent,
    CurrentCheckpointStorageUsageItem,
    CurrentCheckpointStorageUsageResponse,
    SamplingPrefillBillingEvent,
    SamplingSampleBillingEvent,
    StorageBillingEvent,
    TrainingBillingEvent,
)
from treadle.types.billing_usage import MAX_USAGE_WINDOW_DAYS, STORAGE_HOURS_PER_MONTH

router = APIRouter(prefix="/api/v1/billing/usage", tags=["billing"])

HOUR = timedelta(hours=1)


def _hour_boundary(name: str, raw: str) -> datetime:
    example = "2026-07-13T00:00:00Z"
    try:
        moment = datetime.fromisoformat(raw)
    except ValueError:
        raise InvalidInput(
            f"{name} {raw[:40]!r} is not an RFC 3339 time; send one such as {example}"
        ) from None
    if moment.tzinfo is None:
        raise InvalidInput(f"{name} has no time zone; send a UTC time such as {example}")
    moment = moment.astimezone(UTC)
    if moment != moment.replace(minute=0, second=0, microsecond=0):
        raise InvalidInput(
            f"{name} {raw[:40]!r} is not on a UTC hour boundary; round it to the hour, "
            f"e.g. {moment.replace(minute=0, second=0, microsecond=0).isoformat()}"
        )
    return moment


def _dollars(micros: int) -> float:
    return micros / 1_000_000


def _per_million(rate: Rate | None, cached: bool = False) -> float | None:
    if rate is None:
        return None
    unit = rate.unit_micros
    if cached and rate.cached_unit_micros is not None:
        unit = rate.cached_unit_micros
    return _dollars(unit)


def _per_sdk_month(rate: Rate | None) -> float | None:
    """A storage rate per GB-month of 730 hours, as a rate per month of 720 hours."""
    if rate is None:
        return None
    return _dollars(rate.unit_micros) * STORAGE_HOURS_PER_MONTH / HOURS_PER_MONTH


def _events(row: reports.HourlyUsage) -> list[tuple[BillingEventInfo, int]]:
    """The wire events of one rollup with the amount each carries; cached and uncached
    prefill are separate events, the cached part's cost at its own rate."""
    if row.kind == "training":
        return [(TrainingBillingEvent(token_count=row.quantity), row.amount_micros)]
    if row.kind == "sampling_sample":
        return [(SamplingSampleBillingEvent(token_count=row.quantity), row.amount_micros)]
    if row.kind == "checkpoint":
        return [(CheckpointBillingEvent(count=row.quantity), row.amount_micros)]
    if row.kind == "storage":
        hours = row.quantity / BYTES_PER_GB
        return [(StorageBillingEvent(gigabyte_hours=hours), row.amount_micros)]
    cached = min(row.cached_quantity, row.quantity)
    if cached == 0:
        return [
            (SamplingPrefillBillingEvent(cached=False, token_count=row.quantity), row.amount_micros)
        ]
    unit = 0
    if row.rate is not None:
        unit = row.rate.unit_micros
        if row.rate.cached_unit_micros is not None:
            unit = row.rate.cached_unit_micros
    cached_micros = min((cached * unit + 500_000) // 1_000_000, row.amount_micros)
    events: list[tuple[BillingEventInfo, int]] = []
    if row.quantity > cached:
        events.append(
            (
                SamplingPrefillBillingEvent(cached=False, token_count=row.quantity - cached),
                row.amount_micros - cached_micros,
            )
        )
    events.append((SamplingPrefillBillingEvent(cached=True, token_count=cached), cached_micros))
    return events


@router.get(
    "/events",
    response_model=BillingUsageResponse,
    responses=error_responses(401, 403, 422),
)
def usage_events(
    principal: CurrentPrincipal,
    db: ReadSession,
    state: State,
    starting_on: str = Query(
        description="Inclusive window start, an RFC 3339 time on a UTC hour boundary."
    ),
    ending_before: str = Query(
        description="Exclusive window end on a UTC hour boundary, at most 14 days later."
    ),
) -> BillingUsageResponse:
    """The caller's usage per UTC hour, usage kind, base model, session and API key, with what
    it cost. Storage has no base model or session: it is metered per tenant, once an hour has
    ended."""
    start = _hour_boundary("starting_on", starting_on)
    end = _hour_boundary("ending_before", ending_before)
    if start > state.clock.now():
        raise InvalidInput("starting_on is in the future; send a window that has begun")
    if end <= start:
        raise InvalidInput("ending_before is not after starting_on; send a later ending_before")
    if end - start > timedelta(days=MAX_USAGE_WINDOW_DAYS):
        raise InvalidInput(
            f"the window spans more than {MAX_USAGE_WINDOW_DAYS} days; split it into windows "
            f"of at most {MAX_USAGE_WINDOW_DAYS} days"
        )
    rows = reports.hourly_usage(db, principal.tenant_id, start, end)
    sessions = reports.session_details(
        db, principal.tenant_id, {r.session_id for r in rows if r.session_id}
    )
    names = reports.key_names(db, principal.tenant_id, {r.api_key_id for r in rows if r.api_key_id})
    data = []
    for row in rows:
        session = sessions.get(row.session_id or "")
        for info, amount in _events(row):
            cached = isinstance(info, SamplingPrefillBillingEvent) and info.cached
            data.append(
                BillingUsageEvent(
                    bucket_start=row.hour,
                    bucket_end=row.hour + HOUR,
                    base_model=None if row.base_model == ANY_MODEL else row.base_model,
                    user_id=row.api_key_id,
                    user_name=names.get(row.api_key_id or ""),
                    session_id=row.session_id,
                    project_id=session.project_id if session else None,
                    estimated_cost_usd=None if row.rate is None else _dollars(amount),
                    effective_rate_usd_per_million_tokens=(
                        _per_million(row.rate, cached)
                        if row.kind in ("training", "sampling_prefill", "sampling_sample")
                        else None
                    ),
                    effective_rate_usd_per_gigabyte_month=(
                        _per_sdk_month(row.rate) if row.kind == "storage" else None
                    ),
                    amount_micros=amount,
                    event_info=info,
                )
            )
    return BillingUsageResponse(
        data=data,
        sessions={
            sid: BillingUsageSession(user_metadata=string_metadata(details.user_metadata))
            for sid, details in sessions.items()
        },
    )


@router.get(
    "/checkpoints/current",
    response_model=CurrentCheckpointStorageUsageResponse,
    responses=error_responses(401, 403, 422),
)
def current_checkpoint_storage(
    principal: CurrentPrincipal,
    db: ReadSession,
    state: State,
    project_id: str | None = Query(
        None, max_length=200, description="Only checkpoints made in sessions of this project."
    ),
) -> CurrentCheckpointStorageUsageResponse:
    """The caller's ready, unexpired checkpoints now, per project and session owner (API key),
    with a 720-hour month's cost at the storage rate in force now."""
    now = state.clock.now()
    rate = _per_sdk_month(rate_in_force(db, ANY_MODEL, "storage", now))
    held = reports.stored_checkpoints(db, principal.tenant_id, now, project_id=project_id)
    names = reports.key_names(db, principal.tenant_id, {h.api_key_id for h in held if h.api_key_id})
    return CurrentCheckpointStorageUsageResponse(
        effective_rate_usd_per_gigabyte_month=rate,
        data=[
            CurrentCheckpointStorageUsageItem(
                project_id=h.project_id,
                org_user_urn=h.api_key_id,
                user_name=names.get(h.api_key_id or ""),
                checkpoint_count=h.count,
                size_bytes=h.size_bytes,
                size_gigabytes=h.size_bytes / BYTES_PER_GB,
                estimated_monthly_cost_usd=(
                    None if rate is None else rate * h.size_bytes / BYTES_PER_GB
                ),
            )
            for h in held
        ],
    )
