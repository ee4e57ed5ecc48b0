"""Tenants: the one write path for creating and changing them."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session as OrmSession

from core.clock import Clock
from core.errors import InvalidInput, NotFound
from core.ids import new_tenant_id
from core.tables import Tenant

MAX_LORA_RANK_CEILING = 1024


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
) -> Tenant:
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
    db.add(tenant)
    db.flush()
    return tenant


def update_tenant_limits(
    db: OrmSession,
    tenant: Tenant,
    *,
    max_concurrent_sessions: int | None = None,
    max_lora_rank: int | None = None,
    spend_limit_micros: int | None = None,
    clear_spend_limit: bool = False,
) -> Tenant:
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
    tenant.max_concurrent_sessions = new_sessions
    tenant.max_lora_rank = new_rank
    tenant.spend_limit_micros = new_spend
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
