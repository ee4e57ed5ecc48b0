"""Placement: which live worker holds a training run or a sampling session.

A target goes to a live worker (lease not expired) that serves its base model with enough
devices (a worker group's ranks; a model may need several, `TREADLE_MODEL_DEVICES`),
preferring the one holding the fewest active runs per device, then the larger group. A
nameless sampler snapshot goes where its training run is, when that worker is alive; a live
sampler (`live:<run>`, the run's current weights) always goes where its run is, placing the run
first when no live worker holds it. Nothing here talks to workers; the dispatcher does.
"""

from __future__ import annotations

from datetime import datetime
from fractions import Fraction

from sqlalchemy import func, select
from sqlalchemy.orm import Session as OrmSession

from core import runs
from core.settings import Settings
from core.tables import SamplingSession, TrainingRun, Worker
from scheduler import workers


def _devices(worker: Worker, model: str) -> int | None:
    """The devices `worker` registered `model` with (None: it does not serve it)."""
    for entry in worker.models:
        if entry["name"] == model:
            return int(entry.get("devices", 1))
    return None


def live_servers(
    db: OrmSession, settings: Settings, now: datetime, base_model: str
) -> list[Worker]:
    """The live workers serving `base_model` (an alias: the model it names) with as many
    devices as it needs: the most any of them registered it with, so while a group that
    large lives, a worker configured with fewer devices for the model is passed over."""
    served = settings.model_aliases.get(base_model, base_model)
    serving = [(w, n) for w in workers.live(db, now) if (n := _devices(w, served)) is not None]
    needed = max((n for _, n in serving), default=1)
    return [w for w, _ in serving if w.group_size >= needed]


def choose_worker(
    db: OrmSession, settings: Settings, now: datetime, base_model: str, prefer: str | None = None
) -> str | None:
    candidates = live_servers(db, settings, now, base_model)
    if not candidates:
        return None
    if prefer is not None and any(w.id == prefer for w in candidates):
        return prefer
    rows = db.execute(
        select(TrainingRun.worker_id, func.count())
        .where(TrainingRun.status.in_(runs.HOLDING), TrainingRun.worker_id.is_not(None))
        .group_by(TrainingRun.worker_id)
    ).all()
    load = {worker_id: count for worker_id, count in rows}
    # Runs per device: a group of 4 takes about 4 times the runs of one device before it
    # counts as as loaded. Compared as fractions, so equal loads tie exactly.
    return min(
        candidates,
        key=lambda w: (Fraction(load.get(w.id, 0), max(w.group_size, 1)), -w.group_size, w.id),
    ).id


def place(db: OrmSession, settings: Settings, now: datetime, target_id: str) -> str | None:
    """The worker holding `target_id`, placing it first if needed; None when none can take it."""
    run = db.get(TrainingRun, target_id)
    if run is not None:
        if run.worker_id is None or not workers.is_alive(db, run.worker_id, now):
            runs.assign_worker(run, choose_worker(db, settings, now, run.base_model))
        return run.worker_id
    sampler = db.get(SamplingSession, target_id)
    if sampler is None:
        return None
    if runs.is_live(sampler):
        assert sampler.training_run_id is not None
        runs.assign_worker(sampler, place(db, settings, now, sampler.training_run_id))
        return sampler.worker_id
    if sampler.worker_id is None or not workers.is_alive(db, sampler.worker_id, now):
        prefer = None
        if sampler.training_run_id is not None:
            owner = db.get(TrainingRun, sampler.training_run_id)
            prefer = owner.worker_id if owner is not None else None
        runs.assign_worker(sampler, choose_worker(db, settings, now, sampler.base_model, prefer))
    return sampler.worker_id
