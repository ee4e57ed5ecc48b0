"""Tenants: the one write path for creating and changing them."""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields

from sqlalchemy import select
from sqlalchemy.orm import Session as OrmSession

from core import audit
from core.clock import Clock, SystemClock
from core.errors import InvalidInput, NotFound
from core.ids import new_tenant_id
from core.tables import Tenant

MAX_LORA_RANK_CEILING = 1024
_STRIPE_CUSTOMER_ID = re.compile(r"cus_[A-Za-z0-9]{1,96}")


@dataclass(frozen=True)
class ResourceLimits:
    """What one tenant may hold at once. The scheduler enforces them when work is admitted."""

    max_training_runs: int  # training runs alive (not unloaded, in an open session)
    max_lora_parameters: int  # LoRA parameters summed over those runs
    max_queued_ops: int  # operations queued or running
    max_sampling_requests: int  # sampling requests queued or running


# For tenants whose own value is unset (NULL). Far above what one user's training loop
# needs, yet they bound what a broken or hostile client can pile up: 2e9 LoRA parameters are
# about 32 GB of fp32 weights, gradients and AdamW moments.
DEFAULT_LIMITS = ResourceLimits(
    max_training_runs=64,
    max_lora_parameters=2_000_000_000,
    max_queued_ops=10_000,
    max_sampling_requests=1_024,
)
RESOURCE_LIMIT_NAMES = tuple(f.name for f in fields(ResourceLimits))
# The largest value each column holds (INTEGER, or BIGINT for parameters).
_LIMIT_CEILINGS = {name: 2**31 - 1 for name in RESOURCE_LIMIT_NAMES} | {
    "max_lora_parameters": 2**63 - 1
}


def resource_limits(tenant: Tenant) -> ResourceLimits:
    """The limits in force for `tenant`: its own values, else the server's defaults."""
    values: dict[str, int] = {}
    for name in RESOURCE_LIMIT_NAMES:
        own: int | None = getattr(tenant, name)
        values[name] = getattr(DEFAULT_LIMITS, name) if own is None else own
    return ResourceLimits(**values)


def _set_resource_limits(tenant: Tenant, changes: Mapping[str, int | None]) -> None:
    """Apply `changes` (None: back to the server default) after checking every value."""
    for name, value in changes.items():
        if name not in RESOURCE_LIMIT_NAMES:
            raise InvalidInput(
                f"unknown resource limit {name!r}; use one of {RESOURCE_LIMIT_NAMES}"
            )
        if value is not None and not 0 <= value <= _LIMIT_CEILINGS[name]:
            raise InvalidInput(
                f"{name} {value} is outside 0..{_LIMIT_CEILINGS[name]}; pass a value in that "
                "range, or the default"
            )
    for name, value in changes.items():
        setattr(tenant, name, value)


def _check_limits(
    max_concurrent_sessions: int, max_lora_rank: int, spend_limit_micros: int | None
) -> None:
    if max_concurrent_sessions < 0:
        raise InvalidInput(
            f"max concurrent sessions {max_concurrent_sessions} is negative; pass 0 or more"
        )
    if not 1 <= max_lora_rank <= MAX_LORA_RANK_CEILING:
        raise InvalidInput(
            f"max LoRA rank {max_lora_rank} is outside 1..{MAX_LORA_RANK_CEILING}; pass a rank in that range"
        )
    if spend_limit_micros is not None and spend_limit_micros < 0:
        raise InvalidInput("spend limit is negative; pass 0 or more, or no limit")


def create_tenant(
    db: OrmSession,
    clock: Clock,
    name: str,
    *,
    max_concurrent_sessions: int,
    max_lora_rank: int,
    spend_limit_micros: int | None = None,
    limits: Mapping[str, int | None] | None = None,
) -> Tenant:
    """A new tenant; `limits` sets resource limits by name (unset ones follow the defaults)."""
    name = name.strip()
    if not name:
        raise InvalidInput("tenant name is empty; pass a non-empty name")
    _check_limits(max_concurrent_sessions, max_lora_rank, spend_limit_micros)
    if db.scalar(select(Tenant.id).where(Tenant.name == name)) is not None:
        raise InvalidInput(f"a tenant named {name!r} already exists; pick another name")
    tenant = Tenant(
        id=new_tenant_id(),
        name=name,
        max_concurrent_sessions=max_concurrent_sessions,
        max_lora_rank=max_lora_rank,
        spend_limit_micros=spend_limit_micros,
        created_at=clock.now(),
    )
    _set_resource_limits(tenant, limits or {})
    db.add(tenant)
    db.flush()
    return tenant


def update_tenant_limits(
    db: OrmSession,
    tenant: Tenant,
    *,
    clock: Clock | None = None,
    actor: str = "operator",
    max_concurrent_sessions: int | None = None,
    max_lora_rank: int | None = None,
    spend_limit_micros: int | None = None,
    clear_spend_limit: bool = False,
    limits: Mapping[str, int | None] | None = None,
) -> Tenant:
    """Change the limits given; `limits` maps resource limit names to a value, or to None to
    follow the server's default again. A change is written to the audit log (as
    "tenant.limit_changed", with each changed limit's old and new value) by `actor`."""
    before = _limit_values(tenant)
    new_sessions = (
        tenant.max_concurrent_sessions
        if max_concurrent_sessions is None
        else max_concurrent_sessions
    )
    new_rank = tenant.max_lora_rank if max_lora_rank is None else max_lora_rank
    new_spend = (
        None
        if clear_spend_limit
        else (spend_limit_micros if spend_limit_micros is not None else tenant.spend_limit_micros)
    )
    _check_limits(new_sessions, new_rank, new_spend)
    _set_resource_limits(tenant, limits or {})
    tenant.max_concurrent_sessions = new_sessions
    tenant.max_lora_rank = new_rank
    tenant.spend_limit_micros = new_spend
    after = _limit_values(tenant)
    changed = {
        name: {"from": before[name], "to": after[name]}
        for name in after
        if before[name] != after[name]
    }
    if changed:
        audit.record(
            db,
            clock or SystemClock(),
            tenant_id=tenant.id,
            actor=actor,
            action="tenant.limit_changed",
            target=tenant.id,
            detail=changed,
        )
    db.flush()
    return tenant


def _limit_values(tenant: Tenant) -> dict[str, int | None]:
    return {
        "max_concurrent_sessions": tenant.max_concurrent_sessions,
        "max_lora_rank": tenant.max_lora_rank,
        "spend_limit_micros": tenant.spend_limit_micros,
        "session_spend_limit_micros": tenant.session_spend_limit_micros,
        **{name: getattr(tenant, name) for name in RESOURCE_LIMIT_NAMES},
    }


def link_stripe_customer(
    db: OrmSession, clock: Clock, tenant: Tenant, stripe_customer_id: str, *, actor: str
) -> Tenant:
    """Bill `tenant` to a Stripe customer from now on: the Stripe pusher sends its usage there.
    Usage already pushed stays with the customer it went to."""
    if not _STRIPE_CUSTOMER_ID.fullmatch(stripe_customer_id):
        raise InvalidInput(
            f"{stripe_customer_id[:120]!r} is not a Stripe customer id; pass the id Stripe shows "
            "for the customer, e.g. cus_NffrFeUfNV2Hib"
        )
    previous = tenant.stripe_customer_id
    tenant.stripe_customer_id = stripe_customer_id
    audit.record(
        db,
        clock,
        tenant_id=tenant.id,
        actor=actor,
        action="tenant.stripe_linked",
        target=stripe_customer_id,
        detail={"previous": previous},
    )
    db.flush()
    return tenant


def find_tenant(db: OrmSession, name_or_id: str) -> Tenant:
    tenant = db.scalar(
        select(Tenant).where((Tenant.name == name_or_id) | (Tenant.id == name_or_id))
    )
    if tenant is None:
        raise NotFound(
            f"no tenant named {name_or_id!r}; list tenants with `treadle-server admin tenants list`"
        )
    return tenant


def list_tenants(db: OrmSession) -> list[Tenant]:
    return list(db.scalars(select(Tenant).order_by(Tenant.created_at, Tenant.name)))


def lock_tenant(db: OrmSession, tenant_id: str) -> Tenant:
    """The tenant's row, locked until the transaction ends, so that checks against its limits
    run one at a time: a row lock on PostgreSQL (SQLite's write transactions are serialised
    already). FOR NO KEY UPDATE, unlike FOR UPDATE, lets rows that reference the tenant be
    inserted meanwhile (a worker's usage events), so only the checks wait for each other."""
    locked = select(Tenant).where(Tenant.id == tenant_id).with_for_update(key_share=True)
    # Values read earlier in the transaction may predate the lock: read them again.
    tenant = db.scalar(locked.execution_options(populate_existing=True))
    if tenant is None:
        raise NotFound("tenant not found")
    return tenant


class Keep(enum.Enum):
    """`set_spend_limits`: leave this limit as it is."""

    KEEP = "keep"


def set_spend_limits(
    db: OrmSession,
    clock: Clock,
    tenant: Tenant,
    *,
    monthly_micros: int | Keep | None = Keep.KEEP,
    per_session_micros: int | Keep | None = Keep.KEEP,
    actor: str = "operator",
) -> Tenant:
    """Set the tenant's spend limits, in micro-units: per billing period (`monthly_micros`) and
    per session (`per_session_micros`); None removes a limit, `Keep.KEEP` keeps it. The change
    is written to the audit log as "tenant.limit_changed" with each limit's old and new value.
    New limits apply to the next submission; work already accepted finishes."""
    changes = {
        "spend_limit_micros": monthly_micros,
        "session_spend_limit_micros": per_session_micros,
    }
    detail: dict[str, object] = {}
    for name, value in changes.items():
        if isinstance(value, Keep):
            continue
        if value is not None and value < 0:
            option = "--monthly" if name == "spend_limit_micros" else "--per-session"
            raise InvalidInput(f"{option} is negative; pass 0 or more dollars, or no limit")
        old = getattr(tenant, name)
        if old != value:
            detail[name] = {"from": old, "to": value}
            setattr(tenant, name, value)
    if detail:
        audit.record(
            db,
            clock,
            tenant_id=tenant.id,
            actor=actor,
            action="tenant.limit_changed",
            target=tenant.id,
            detail=detail,
        )
    db.flush()
    return tenant
