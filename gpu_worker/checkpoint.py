"""Adapter and optimizer state on local disk: resumable states, PEFT exports, merged exports.

A state folder is a PEFT adapter folder (adapter_config.json + adapter_model.safetensors,
loadable by `peft.PeftModel.from_pretrained`) plus `treadle_state.json` (LoRA spec, base
model, optimizer step count) and, when requested, `optimizer.safetensors` (AdamW moments per
parameter). A merged export is a plain Hugging Face model folder with the adapter folded into
the base weights, plus the tokenizer files.

Paths are ordinary local folders given by the caller; object storage is the caller's job.
This module knows nothing of runs' scheduling or of HTTP.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from gpu_worker import fsdp
from gpu_worker.lora import LoraAdapter, target_module_names
from gpu_worker.protocol import LoraSpec, UserInputError

PEFT_PREFIX = "base_model.model."
STATE_FILE = "treadle_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"


def save_adapter(adapter: LoraAdapter, folder: Path, base_model: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        PEFT_PREFIX + k: v.to("cpu", torch.float32).contiguous()
        for k, v in adapter.named_tensors().items()
    }
    save_file(tensors, str(folder / ADAPTER_FILE))
    spec = adapter.spec
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "target_modules": target_module_names(spec),
        "modules_to_save": None,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def save_state(
    adapter: LoraAdapter,
    optimizer: torch.optim.Optimizer | None,
    steps: int,
    folder: Path,
    base_model: str,
) -> None:
    save_adapter(adapter, folder, base_model)
    meta = {
        "format": 1,
        "base_model": base_model,
        "lora": asdict(adapter.spec),
        "optim_steps": steps,
        "has_optimizer": optimizer is not None,
    }
    if optimizer is not None:
        tensors: dict[str, torch.Tensor] = {}
        names = [f"{n}.{ab}" for n in sorted(adapter.weights) for ab in ("lora_A", "lora_B")]
        for name, p in zip(names, adapter.parameters(), strict=True):
            state = optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq", "step"):
                if key in state:
                    tensors[f"{name}.{key}"] = (
                        state[key].detach().to("cpu").reshape(state[key].shape).contiguous()
                    )
        save_file(tensors, str(folder / OPTIMIZER_FILE))
    elif (folder / OPTIMIZER_FILE).exists():
        (folder / OPTIMIZER_FILE).unlink()
    (folder / STATE_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def read_meta(folder: Path) -> dict:
    path = folder / STATE_FILE
    if not path.exists():
        raise UserInputError(
            f"{folder} is not a saved training state ({STATE_FILE} missing); "
            "pass a path written by save_state"
        )
    return json.loads(path.read_text())


def spec_from_meta(meta: dict) -> LoraSpec:
    return LoraSpec(**meta["lora"])


def load_adapter_tensors(folder: Path) -> dict[str, torch.Tensor]:
    raw = load_file(str(folder / ADAPTER_FILE))
    return {k.removeprefix(PEFT_PREFIX): v for k, v in raw.items()}


@dataclass
class SavedState:
    """A state folder read into memory (CPU tensors): what `Engine.load_state_tensors` needs,
    without the folder. `optimizer` is None when the moments were not asked for."""

    folder: Path
    meta: dict
    adapter: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor] | None


def read_state(folder: Path, include_optimizer: bool) -> SavedState:
    meta = read_meta(folder)
    optimizer = read_optimizer_tensors(folder) if include_optimizer else None
    return SavedState(folder, meta, load_adapter_tensors(folder), optimizer)


def read_optimizer_tensors(folder: Path) -> dict[str, torch.Tensor]:
    path = folder / OPTIMIZER_FILE
    if not path.exists():
        raise UserInputError(
            f"{folder} holds no optimizer state; load it without the optimizer "
            "or pick a state saved with include_optimizer=True"
        )
    return load_file(str(path))


def apply_optimizer_state(
    adapter: LoraAdapter, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]
) -> None:
    """Replace the optimizer's moments with `tensors` (as `read_optimizer_tensors` returns
    them), copied onto the adapter's device."""
    names = [f"{n}.{ab}" for n in sorted(adapter.weights) for ab in ("lora_A", "lora_B")]
    optimizer.state.clear()
    device = adapter.parameters()[0].device
    for name, p in zip(names, adapter.parameters(), strict=True):
        if f"{name}.exp_avg" in tensors:
            optimizer.state[p] = {
                "step": tensors[f"{name}.step"].clone(),
                "exp_avg": tensors[f"{name}.exp_avg"].to(device).clone(),
                "exp_avg_sq": tensors[f"{name}.exp_avg_sq"].to(device).clone(),
            }


class WriteFailed(RuntimeError):
    """A merged export gathered the weights and then failed to write them (a full disk, say):
    only the rank that writes had it, after every collective of the export was done."""


@dataclass
class MergedTarget:
    """Where a merged export goes, made ready before any weight is gathered: the folder,
    created, and the tokenizer files to copy into it."""

    folder: Path
    tokenizer_files: list[Path]


def prepare_merged(folder: Path, tokenizer_dir: Path) -> MergedTarget:
    """Everything of a merged export that can fail before the weights are gathered (a worker
    group's rank 0 does this before its ranks start gathering, so that no rank waits in an
    all-gather for one that failed)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = [
        f
        for f in sorted(tokenizer_dir.iterdir())
        if f.is_file()
        and f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges"))
    ]
    return MergedTarget(folder, files)


@torch.no_grad()
def full_state(model: Any, keep: bool = True) -> dict[str, torch.Tensor]:
    """The model's weights, whole, on the CPU in float32. Weights sharded over a worker
    group's ranks are gathered one by one, so every rank must call this alike; a rank that
    only takes part in the gathers passes `keep=False`, gets an empty dict and frees each
    weight as soon as it is gathered."""
    state: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        whole = fsdp.full_tensor(v.detach())
        if keep:
            state[k] = whole.to("cpu", torch.float32)
        del whole
    return state


def export_merged(
    model: Any, adapter: LoraAdapter | None, folder: Path, tokenizer_dir: Path
) -> None:
    """Write a transformers-loadable folder whose weights are base + scale · B A."""
    write_merged(model, adapter, full_state(model), prepare_merged(folder, tokenizer_dir))


def write_merged(
    model: Any, adapter: LoraAdapter | None, state: dict[str, torch.Tensor], target: MergedTarget
) -> None:
    """Fold the adapter into `state` (the model's whole weights, as `full_state` gives them)
    and write the folder `prepare_merged` made. Nothing here is a collective."""
    config = copy.deepcopy(model.config)
    if adapter is not None:
        for name, (a_rI, b_Or) in adapter.weights.items():
            key = f"{name}.weight"
            state[key] = state[key] + adapter.scale * (b_Or.detach().cpu() @ a_rI.detach().cpu())
    tied = bool(getattr(config, "tie_word_embeddings", False))
    lm_head_trained = adapter is not None and "lm_head" in adapter.weights
    if tied and lm_head_trained:
        config.tie_word_embeddings = False  # the adapter made the unembedding differ
    elif tied:
        state.pop("lm_head.weight", None)
    state = {k: v.contiguous().clone() for k, v in state.items()}
    save_file(state, str(target.folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(target.folder))
    for f in target.tokenizer_files:
        shutil.copy(f, target.folder / f.name)
