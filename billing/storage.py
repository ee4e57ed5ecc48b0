"""Checkpoint storage metering: one `storage` usage event per tenant per whole UTC hour, for
the bytes of ready checkpoints the tenant held during that hour.

A checkpoint counts for the part of the hour between its creation and its expiry (byte-hours,
so a checkpoint held half the hour counts half its bytes). What is metered is stored artifacts,
not versions: versions sharing one artifact (a promoted copy and its source) count its bytes
once, for the hours any of them is held. A deleted checkpoint counts for no
hour metered after its deletion: versions keep no deletion time, so an hour metered late (after
a pause of the job) does not count checkpoints deleted since.

Metering is idempotent per (tenant, hour) (the unique index `uq_usage_events_storage_hour`):
every run meters each ended hour of the last `CATCH_UP` that has no event yet, so hours missed
while nothing ran are caught up, and two processes metering at once count each hour once. An
event is priced at its hour's start and added to the rollups and the period's spend in the
transaction that inserts it, as the ledger does for operations.

Storage is metered for the tenant as a whole, so its events carry no API key, session or
operation, and `ANY_MODEL` as their base model.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import or_, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session as OrmSession

from billing.prices import ANY_MODEL, Rate, cost_micros, rate_in_force
from billing.rollups import RolledEvent, add_to_rollups
from billing.spend import add_spend
from billing.tables import UsageEvent
from core.clock import Clock
from core.tables import ModelVersion, VersionStatus

STORAGE = "storage"
HOUR = timedelta(hours=1)
CATCH_UP = timedelta(hours=48)
"""How far back a run meters hours that have no event yet."""


@dataclass(frozen=True)
class MeteredHour:
    tenant_id: str
    hour: datetime
    byte_hours: int
    amount_micros: int


@dataclass(frozen=True)
class _Held:
    """One stored artifact: its size, and when each version on it was created and expires."""

    size_bytes: int
    spans: list[tuple[datetime, datetime | None]]


def hour_of(moment: datetime) -> datetime:
    """The start of the UTC hour holding `moment`."""
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def byte_hours(held: list[_Held], hour: datetime) -> int:
    """The bytes held during the hour starting at `hour`, weighted by the share of the hour
    each artifact was held by any of its versions (rounded down to a whole byte)."""
    end = hour + HOUR
    byte_seconds = 0
    for h in held:
        clipped = sorted(
            (max(created, hour), end if expires is None else min(expires, end))
            for created, expires in h.spans
        )
        seconds, reached = 0.0, hour
        for start, stop in clipped:
            start = max(start, reached)
            if stop > start:
                seconds += (stop - start).total_seconds()
                reached = stop
        byte_seconds += h.size_bytes * int(seconds)
    return byte_seconds // int(HOUR.total_seconds())


def meter_storage(
    db: OrmSession, clock: Clock, *, catch_up: timedelta = CATCH_UP
) -> list[MeteredHour]:
    """Write the storage events of every ended hour within `catch_up` that has none yet (one
    per tenant holding bytes in it); returns the events this call inserted."""
    until = hour_of(clock.now())
    since = until - catch_up
    # (tenant, artifact) -> (size, spans); a version whose files are gone counts on its own.
    artifacts: dict[tuple[str, str], tuple[int, list[tuple[datetime, datetime | None]]]] = {}
    for tenant_id, version_id, uri, size, created_at, expires_at in db.execute(
        select(
            ModelVersion.tenant_id,
            ModelVersion.id,
            ModelVersion.artifact_uri,
            ModelVersion.size_bytes,
            ModelVersion.created_at,
            ModelVersion.expires_at,
        ).where(
            ModelVersion.status == VersionStatus.READY,
            ModelVersion.size_bytes > 0,
            ModelVersion.created_at < until,
            or_(ModelVersion.expires_at.is_(None), ModelVersion.expires_at > since),
        )
    ):
        key = (tenant_id, uri if uri is not None else version_id)
        largest, spans = artifacts.get(key, (0, []))
        artifacts[key] = (max(largest, int(size or 0)), [*spans, (created_at, expires_at)])
    held: dict[str, list[_Held]] = defaultdict(list)
    for (tenant_id, _), (size, spans) in artifacts.items():
        held[tenant_id].append(_Held(size, spans))
    if not held:
        return []
    metered = {
        (tenant_id, hour)
        for tenant_id, hour in db.execute(
            select(UsageEvent.tenant_id, UsageEvent.hour).where(
                UsageEvent.kind == STORAGE, UsageEvent.hour >= since, UsageEvent.hour < until
            )
        )
    }
    rates: dict[datetime, Rate | None] = {}
    now = clock.now()
    rows = []
    for tenant_id in sorted(held):
        first = max(since, hour_of(min(c for h in held[tenant_id] for c, _ in h.spans)))
        hour = first
        while hour < until:
            quantity = byte_hours(held[tenant_id], hour)
            if quantity > 0 and (tenant_id, hour) not in metered:
                if hour not in rates:
                    rates[hour] = rate_in_force(db, ANY_MODEL, STORAGE, hour)
                rate = rates[hour]
                rows.append(
                    {
                        "tenant_id": tenant_id,
                        "kind": STORAGE,
                        "base_model": ANY_MODEL,
                        "quantity": quantity,
                        "cached_quantity": 0,
                        "price_id": None if rate is None else rate.id,
                        "amount_micros": cost_micros(rate, quantity),
                        "hour": hour,
                        "created_at": now,
                    }
                )
            hour += HOUR
    if not rows:
        return []
    return _insert(db, rows)


def _insert(db: OrmSession, rows: list[dict[str, object]]) -> list[MeteredHour]:
    """Insert the events none of which another run inserted meanwhile, then count those."""
    insert = postgresql.insert if db.get_bind().dialect.name == "postgresql" else sqlite.insert
    inserted = db.execute(
        insert(UsageEvent)
        .values(rows)
        .on_conflict_do_nothing(
            index_elements=["tenant_id", "hour"], index_where=text("kind = 'storage'")
        )
        .returning(
            UsageEvent.tenant_id,
            UsageEvent.hour,
            UsageEvent.quantity,
            UsageEvent.price_id,
            UsageEvent.amount_micros,
        )
    ).all()
    add_to_rollups(
        db,
        (
            RolledEvent(
                tenant_id=tenant_id,
                hour=hour,
                api_key_id=None,
                session_id=None,
                base_model=ANY_MODEL,
                kind=STORAGE,
                price_id=price_id,
                quantity=int(quantity),
                cached_quantity=0,
                amount_micros=int(amount),
            )
            for tenant_id, hour, quantity, price_id, amount in inserted
        ),
    )
    for tenant_id, hour, _, _, amount in inserted:
        add_spend(db, tenant_id, hour, int(amount))
    return [
        MeteredHour(tenant_id, hour, int(quantity), int(amount))
        for tenant_id, hour, quantity, _, amount in inserted
    ]
