"""Admitting a new training run under its tenant's limits (`core.tenants.ResourceLimits`).

A tenant may hold `max_training_runs` live runs, whose adapters together hold at most
`max_lora_parameters` LoRA parameters. A run is live until it is unloaded or its session ends
(finished, or silent past the TTL), and unless its creation failed. Both limits are permanent
conditions that waiting does not lift, so a refusal is `QuotaExceeded` (403).

Adapter sizes come from the workers: each registers, per model, the LoRA parameters per unit
of rank of each trainable part (attention, MLP, unembedding), measured on the model itself, so
the API sizes adapters without torch. A model no worker has registered yet cannot be sized,
and its runs count under the run limit only. Queue limits on operations are checked where
operations are submitted (`scheduler.submit`).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from sqlalchemy import exists, select
from sqlalchemy.orm import Session as OrmSession

from core import runs
from core.clock import Clock
from core.errors import QuotaExceeded
from core.tables import Operation, OpStatus, Session, SessionStatus, TrainingRun
from core.tenants import lock_tenant, resource_limits
from scheduler.served import lora_parameters_per_rank

ADAPTER_PARTS = ("attn", "mlp", "unembed")


def trained_parts(lora_config: Mapping[str, Any]) -> list[str]:
    return [part for part in ADAPTER_PARTS if lora_config.get(f"train_{part}", True)]


def lora_parameters(rank: int, lora_config: Mapping[str, Any], per_rank: Mapping[str, int]) -> int:
    """Parameters of a rank-`rank` adapter training the parts `lora_config` selects."""
    return rank * sum(int(per_rank.get(part, 0)) for part in trained_parts(lora_config))


def admit_training_run(
    db: OrmSession,
    clock: Clock,
    *,
    tenant_id: str,
    run_id: str,
    base_model: str,
    lora_config: Mapping[str, Any],
    model_aliases: Mapping[str, str],
    session_ttl_seconds: float,
) -> None:
    """Raise QuotaExceeded unless the tenant may create run `run_id` with this adapter.

    A run that exists already is a retried creation, answered as before whatever the limits
    say now; it is looked for once the tenant is locked, so a retry racing its original sees
    it. Call this in the transaction that then creates the run: the lock lasts until it ends.
    """
    tenant = lock_tenant(db, tenant_id)
    if db.get(TrainingRun, run_id) is not None:
        return
    limits = resource_limits(tenant)
    alive = _live_runs(db, clock, tenant_id, session_ttl_seconds)
    if len(alive) >= limits.max_training_runs:
        raise QuotaExceeded(
            f"training run limit reached: tenant {tenant.name!r} allows "
            f"{limits.max_training_runs} live training runs and {len(alive)} are live; unload "
            "one (unload_model), end the session that holds it, or ask the operator to raise "
            "max_training_runs"
        )
    sizes = lora_parameters_per_rank(db)

    def size(model: str, rank: int, config: Mapping[str, Any]) -> int:
        per_rank = sizes.get(model_aliases.get(model, model))
        return 0 if per_rank is None else lora_parameters(rank, config, per_rank)

    in_use = sum(size(model, rank, config) for model, rank, config in alive)
    rank = runs.lora_rank(lora_config)
    needed = size(base_model, rank, lora_config)
    if in_use + needed > limits.max_lora_parameters:
        parts = ", ".join(trained_parts(lora_config)) or "no parts"
        raise QuotaExceeded(
            f"LoRA parameter limit reached: tenant {tenant.name!r} allows "
            f"{limits.max_lora_parameters:,} LoRA parameters across its live training runs, "
            f"{in_use:,} are in use, and this rank-{rank} adapter on {base_model} ({parts}) "
            f"needs {needed:,}; use a lower rank or train fewer parts (train_attn, train_mlp, "
            "train_unembed), unload a run, or ask the operator to raise max_lora_parameters"
        )


def _live_runs(
    db: OrmSession, clock: Clock, tenant_id: str, session_ttl_seconds: float
) -> list[tuple[str, int, dict[str, Any]]]:
    """(base model, rank, LoRA config) of each live run of the tenant.

    A session silent past the TTL counts as ended even before the sweep marks it, so the limit
    never depends on a timer having run.
    """
    heard_since = clock.now() - timedelta(seconds=session_ttl_seconds)
    creation_failed = exists().where(
        Operation.target_id == TrainingRun.id,
        Operation.seq_id == 0,
        Operation.status == OpStatus.FAILED,
    )
    rows = db.execute(
        select(TrainingRun.base_model, TrainingRun.lora_rank, TrainingRun.lora_config)
        .join(Session, Session.id == TrainingRun.session_id)
        .where(
            TrainingRun.tenant_id == tenant_id,
            TrainingRun.status.in_(runs.HOLDING),
            Session.status == SessionStatus.ACTIVE,
            Session.last_heartbeat_at >= heard_since,
            ~creation_failed,
        )
    ).all()
    return [(model, rank, dict(config or {})) for model, rank, config in rows]
