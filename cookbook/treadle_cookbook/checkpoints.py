"""Checkpoints of a recipe's run, and resuming from the latest one.

`checkpoints.jsonl` in the log folder lists every `save_state` checkpoint as
`{"step": ..., "name": ..., "path": "tinker://..."}`, in the order they were taken. Rerunning a
recipe with the same `log_dir` reads its last line and continues from that step with the
saved weights and optimizer state; the server keeps the checkpoints, this file only names them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from treadle import ServiceClient, TrainingClient
from treadle_cookbook.config import RecipeConfig

CHECKPOINTS_FILE = "checkpoints.jsonl"


def save(training_client: TrainingClient, log_dir: Path, step: int, *, name: str) -> str:
    """Save weights and optimizer state as `name` after `step` steps; returns its path.

    The line is appended only once the server has saved the checkpoint, so the file never
    names one that does not exist.
    """
    path = training_client.save_state(name).result().path
    log_dir.mkdir(parents=True, exist_ok=True)
    with (log_dir / CHECKPOINTS_FILE).open("a") as file:
        file.write(json.dumps({"step": step, "name": name, "path": path}) + "\n")
    return path


def read(log_dir: Path) -> list[dict[str, Any]]:
    """Every checkpoint recorded in `log_dir`, oldest first; [] when there is none."""
    path = Path(log_dir) / CHECKPOINTS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def latest(log_dir: Path) -> dict[str, Any] | None:
    """The last checkpoint recorded in `log_dir`, or None."""
    recorded = read(log_dir)
    return recorded[-1] if recorded else None


def resume(
    service_client: ServiceClient, log_dir: Path, config: RecipeConfig
) -> tuple[TrainingClient, int]:
    """A training client and the step to start from.

    From the latest checkpoint in `log_dir` (weights and optimizer state, in a new run) when
    there is one; else at step 0, a new run from the weights of `config.load_checkpoint_path`
    (with a fresh optimizer: the run that saved them trained something else) when it is set,
    or a new LoRA run on `config.model`.
    """
    checkpoint = latest(log_dir)
    if checkpoint is not None:
        client = service_client.create_training_client_from_state_with_optimizer(checkpoint["path"])
        return client, int(checkpoint["step"])
    if config.load_checkpoint_path is not None:
        return service_client.create_training_client_from_state(config.load_checkpoint_path), 0
    client = service_client.create_lora_training_client(
        config.model, rank=config.lora_rank, seed=config.seed
    )
    return client, 0
