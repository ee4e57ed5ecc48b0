"""Which base models are served, as the workers registered them (torch-free)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session as OrmSession

from core.tables import Worker, WorkerStatus


def tokenizer_key(model: str) -> str:
    """Where a model's tokenizer files are published in the artifact store."""
    return f"models/{model.replace('/', '__')}/tokenizer"


def registered_models(db: OrmSession) -> dict[str, dict[str, Any]]:
    """Model name → what a live worker reported about it (context length, vocabulary)."""
    out: dict[str, dict[str, Any]] = {}
    for models in db.scalars(select(Worker.models).where(Worker.status == WorkerStatus.LIVE)):
        for entry in models:
            out.setdefault(entry["name"], entry)
    return out


def lora_parameters_per_rank(db: OrmSession) -> dict[str, dict[str, int]]:
    """Model name → LoRA parameters per unit of rank of each part (attn, mlp, unembed), as
    workers measured them. A dead worker's figures still hold (a model's shape does not change
    with the worker that serves it); a live worker's come first."""
    out: dict[str, dict[str, int]] = {}
    rows = db.execute(select(Worker.status, Worker.models)).all()
    for _, models in sorted(rows, key=lambda row: row[0] != WorkerStatus.LIVE):
        for entry in models:
            sizes = entry.get("lora_parameters_per_rank")
            if sizes is not None:
                out.setdefault(entry["name"], sizes)
    return out
