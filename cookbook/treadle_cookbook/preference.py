"""Preference training (DPO, KTO): the losses, the frozen reference and the flow both share.

The server computes per-token logprobs; the losses turn them into sequence logprobs of the
reply (the datum's weights are the reply's mask) and compare them with a frozen reference
model's. The reference values come from the training client's own forward pass on the initial
weights, computed once before the first step and kept in `log_dir/reference.json` with a record
of the model and data they belong to, so policy and reference logprobs share one numeric path
and a resume cannot pair them with other data. A batch is a list of pair datums, each pair's
chosen reply then its rejected one (`pair_datums`), with the reference values in the same order.

The implicit reward of a reply is `policy logprob - reference logprob`; the margin of a pair
is the chosen reply's reward minus the rejected one's. Training must push margins up.

torch runs the losses on this machine and is imported only where they run
(`pip install 'treadle-cookbook[preference]'`). This module does not know which loss a recipe
trains with: the recipes choose it and run their own loop.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from treadle import ServiceClient, TrainingClient
from treadle.errors import MissingDependencyError
from treadle.types import Datum
from treadle_cookbook import checkpoints, data
from treadle_cookbook.config import RecipeConfig
from treadle_cookbook.data import Preference
from treadle_cookbook.renderers import Renderer

LossFn = Callable[[list[Datum], list[Any]], tuple[Any, dict[str, float]]]
"""What `forward_backward_custom` calls: (data, per-token logprob tensors) -> (loss, metrics)."""

REFERENCE_FILE = "reference.json"

# The settings that decide which pairs a run trains and evaluates on, in reference.json.
_DATA_OPTIONS = ("model", "data", "seed", "held_out_fraction")


class PreferenceConfig(RecipeConfig):
    """The settings DPO and KTO share; each recipe adds its loss's own."""

    model: str = Field(default="treadle/tiny-1m", description="the served base model")
    data: str = Field(
        default=str(data.SAMPLE_DIR / "preference_sample.jsonl"),
        description="a JSON-lines file of {prompt, chosen, rejected} or a dataset name",
    )
    held_out_fraction: float = Field(default=0.2, description="share of pairs held out")
    steps: int = Field(default=10, description="optimizer steps in all (a resumed run included)")
    batch_size: int = Field(default=4, description="pairs per step")
    learning_rate: float = Field(default=2e-3, description="learning rate")
    beta: float = Field(
        default=0.1,
        description="how far the policy may move from the reference; larger is stricter",
    )
    eval_every: int = Field(default=5, description="steps between margin evaluations")
    save_every: int = Field(default=5, description="steps between state checkpoints")


@dataclass
class PreferenceRun:
    """A preference run ready to train: its client, its pairs as datums and their reference."""

    training_client: TrainingClient
    start_step: int
    train_data: list[Datum]
    held_out_data: list[Datum]
    reference: dict[str, list[float]]

    def batch(self, step: int, batch_size: int, seed: int) -> tuple[list[Datum], list[float]]:
        """Step `step`'s pairs as datums (chosen, rejected, ...) and their reference values."""
        pair_indices = range(len(self.train_data) // 2)
        chosen = data.batch(pair_indices, batch_size, step, seed)
        rows = [row for pair in chosen for row in (2 * pair, 2 * pair + 1)]
        return [self.train_data[row] for row in rows], [
            self.reference["train"][row] for row in rows
        ]

    def evaluate(self) -> dict[str, float]:
        """Mean reward margin on the training and held-out pairs (`train_margin`,
        `held_out_margin`), by a forward pass on the current weights."""
        values = {}
        for split, datums in (("train", self.train_data), ("held_out", self.held_out_data)):
            policy = sequence_logprobs(self.training_client, datums)
            values[f"{split}_margin"] = statistics.fmean(margins(policy, self.reference[split]))
        return values


def start(service: ServiceClient, config: PreferenceConfig) -> PreferenceRun:
    """Resume or create the run, render its pairs and compute or read back their reference.

    Raises:
        MissingDependencyError: torch is not installed, so the losses could not run.
        SystemExit: `reference.json` is missing after step 0 or belongs to other data.
    """
    import_torch()
    training_client, start_step = checkpoints.resume(service, config.log_dir, config)
    renderer = Renderer(training_client.get_tokenizer())
    pairs = data.load_preferences(config.data)
    train, held_out = data.split_held_out(pairs, config.held_out_fraction, config.seed)
    splits = {"train": pair_datums(renderer, train), "held_out": pair_datums(renderer, held_out)}
    options = {name: getattr(config, name) for name in _DATA_OPTIONS}
    reference_file = config.log_dir / REFERENCE_FILE
    if start_step == 0:
        reference = {split: sequence_logprobs(training_client, d) for split, d in splits.items()}
        save_reference(reference_file, reference, options, splits)
    else:
        reference = load_reference(reference_file, options, splits)
    return PreferenceRun(
        training_client, start_step, splits["train"], splits["held_out"], reference
    )


def pair_datums(renderer: Renderer, pairs: Sequence[Preference]) -> list[Datum]:
    """Two datums per pair, chosen then rejected, weight 1 on the reply's tokens only."""
    datums = []
    for pair in pairs:
        datums.append(renderer.reply(pair.prompt, pair.chosen).to_datum())
        datums.append(renderer.reply(pair.prompt, pair.rejected).to_datum())
    return datums


def sequence_logprobs(training_client: TrainingClient, datums: Sequence[Datum]) -> list[float]:
    """Each datum's reply logprob under the run's current weights (a forward pass only)."""
    output = training_client.forward(list(datums), "cross_entropy").result()
    return [
        sum(
            w * lp
            for w, lp in zip(
                datum.loss_fn_inputs["weights"].tolist(), out["logprobs"].tolist(), strict=True
            )
        )
        for datum, out in zip(datums, output.loss_fn_outputs, strict=True)
    ]


def tokens_sha256(splits: dict[str, list[Datum]]) -> str:
    """A digest of every datum's tokens and reply mask, split by split, in order."""
    digest = hashlib.sha256()
    for split, datums in sorted(splits.items()):
        digest.update(split.encode())
        for datum in datums:
            row = [
                datum.model_input.to_ints(),
                datum.loss_fn_inputs["target_tokens"].tolist(),
                datum.loss_fn_inputs["weights"].tolist(),
            ]
            digest.update(json.dumps(row).encode())
    return digest.hexdigest()


def save_reference(
    path: Path,
    reference: dict[str, list[float]],
    options: dict[str, Any],
    splits: dict[str, list[Datum]],
) -> None:
    """Write the reference values with the options and token digest of the data they fit."""
    record = {"options": options, "tokens_sha256": tokens_sha256(splits), **reference}
    path.write_text(json.dumps(record))


def load_reference(
    path: Path, options: dict[str, Any], splits: dict[str, list[Datum]]
) -> dict[str, list[float]]:
    """The reference values kept at step 0, refused unless they fit this run's data.

    Raises:
        SystemExit: the file is missing, or was computed for other options or other tokens
            (a changed --model, --data, --seed, --held_out_fraction or data file).
    """
    fresh = "pass a new --log_dir to start a fresh run"
    if not path.exists():
        raise SystemExit(
            f"{path} is missing and cannot be recomputed: it holds the initial weights' "
            f"logprobs, and this run has trained past them; {fresh}"
        )
    record = json.loads(path.read_text())
    stored = record.get("options", {})
    changed = [
        f"--{name} {stored.get(name)!r} (this run: {value!r})"
        for name, value in options.items()
        if stored.get(name) != value
    ]
    if changed:
        raise SystemExit(
            f"{path} was computed for other pairs than this run's, with {', '.join(changed)}; "
            f"rerun with those values to resume, or {fresh}"
        )
    if record.get("tokens_sha256") != tokens_sha256(splits):
        raise SystemExit(
            f"{path} was computed for other tokens than this run's: the pairs in "
            f"{options['data']!r} or the model's chat template changed since; restore them to "
            f"resume, or {fresh}"
        )
    return {"train": record["train"], "held_out": record["held_out"]}


def margins(policy: Sequence[float], reference: Sequence[float]) -> list[float]:
    """Each pair's reward margin, from interleaved (chosen, rejected) sequence logprobs."""
    rewards = [p - r for p, r in zip(policy, reference, strict=True)]
    return [chosen - rejected for chosen, rejected in zip(rewards[::2], rewards[1::2], strict=True)]


def dpo_loss(reference: Sequence[float], beta: float) -> LossFn:
    """DPO: `-log sigmoid(beta * margin)`, averaged over the batch's pairs.

    Args:
        reference: the batch's reference logprobs, in the order of its datums.
        beta: how far the policy may move from the reference; larger is stricter.

    Metrics: `dpo_margin` (mean margin before the update) and `dpo_accuracy` (share of pairs
    with a positive margin).
    """
    torch = import_torch()

    def loss_fn(data: list[Datum], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
        rewards = _rewards(data, logprobs, reference)
        margin = rewards[0::2] - rewards[1::2]
        loss = -torch.nn.functional.logsigmoid(beta * margin).mean()
        seen = margin.detach()
        return loss, {
            "dpo_margin": float(seen.mean()),
            "dpo_accuracy": float((seen > 0).float().mean()),
        }

    return loss_fn


def kto_loss(
    reference: Sequence[float],
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> LossFn:
    """KTO on a pair batch: chosen replies are desirable, rejected ones undesirable.

    Each reply's reward is compared with a reference point `z`, the batch's mean reward
    clamped at 0 and detached (the paper estimates it from mismatched prompt/reply pairs; the
    batch mean is a simpler estimate of the same KL term). Desirable replies lose
    `1 - sigmoid(beta * (reward - z))`, undesirable ones `1 - sigmoid(beta * (z - reward))`,
    weighted and averaged.

    Metrics: `kto_chosen_reward`, `kto_rejected_reward` and `kto_margin`, their difference.
    """
    torch = import_torch()

    def loss_fn(data: list[Datum], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
        rewards = _rewards(data, logprobs, reference)
        chosen, rejected = rewards[0::2], rewards[1::2]
        z = rewards.detach().mean().clamp(min=0)
        desirable = desirable_weight * (1 - torch.sigmoid(beta * (chosen - z)))
        undesirable = undesirable_weight * (1 - torch.sigmoid(beta * (z - rejected)))
        loss = torch.cat([desirable, undesirable]).mean()
        chosen_seen, rejected_seen = chosen.detach(), rejected.detach()
        return loss, {
            "kto_chosen_reward": float(chosen_seen.mean()),
            "kto_rejected_reward": float(rejected_seen.mean()),
            "kto_margin": float((chosen_seen - rejected_seen).mean()),
        }

    return loss_fn


def import_torch() -> Any:
    """torch, or an error naming the extra that installs it."""
    try:
        import torch
    except ImportError as exc:
        raise MissingDependencyError(
            "the DPO and KTO losses run in torch on this machine; install it with "
            "`pip install 'treadle-cookbook[preference]'`"
        ) from exc
    return torch


def _rewards(data: list[Datum], logprobs: list[Any], reference: Sequence[float]) -> Any:
    """Policy minus reference reply logprob per datum, a 1-D tensor with gradients."""
    torch = import_torch()
    if len(data) % 2 or len(reference) != len(data):
        raise ValueError(
            f"a preference batch is (chosen, rejected) pairs with one reference value per datum; "
            f"got {len(data)} datums and {len(reference)} reference values"
        )
    sequence = torch.stack(
        [
            (logprob * datum.loss_fn_inputs["weights"].to_torch()).sum()
            for datum, logprob in zip(data, logprobs, strict=True)
        ]
    )
    return sequence - torch.tensor(list(reference), dtype=sequence.dtype)
