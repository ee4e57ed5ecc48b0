"""The LoRA sizes a worker publishes for the API's adapter limit: per unit of rank and trained
part, they equal what the engine allocates for a run's adapter."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from gpu_worker.catalog import Catalog
from gpu_worker.engine import Engine, EngineSettings
from gpu_worker.protocol import LoraSpec
from tests.gpu_worker.helpers import training_run

PART_CHOICES = [flags for flags in itertools.product((True, False), repeat=3) if any(flags)]


def _allocated(engine: Engine, model: str, rank: int, flags: tuple[bool, bool, bool]) -> int:
    """Parameters of a new run's adapter (fp32, before any gradient or optimizer moment)."""
    attn, mlp, unembed = flags
    run_id = f"sizing-{model}-{rank}-{flags}"
    spec = LoraSpec(rank=rank, train_attn=attn, train_mlp=mlp, train_unembed=unembed)
    with training_run(engine, run_id, spec, base_model=model):
        return engine.run_memory_bytes(run_id) // 4


def _published(per_rank: dict[str, int], rank: int, flags: tuple[bool, bool, bool]) -> int:
    parts = zip(("attn", "mlp", "unembed"), flags, strict=True)
    return rank * sum(per_rank[part] for part, on in parts if on)


@pytest.mark.unit
@pytest.mark.parametrize("model", ["treadle/tiny-1m", "treadle/tiny-qwen-1m", "treadle/tiny-10m"])
def test_published_sizes_match_the_engines_adapters(engine: Engine, model: str) -> None:
    per_rank = engine.catalog.lora_parameters_per_rank(model)
    assert set(per_rank) == {"attn", "mlp", "unembed"}
    for flags in PART_CHOICES:
        assert _allocated(engine, model, 3, flags) == _published(per_rank, 3, flags), flags


@pytest.mark.unit
def test_a_model_folder_with_grouped_query_attention(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(str(tmp_path / "gqa"))
    entry = Catalog.hf_folder("local/gqa", str(tmp_path / "gqa"))
    engine = Engine(EngineSettings(device="cpu", num_threads=1, catalog_entries=(entry,)))
    per_rank = engine.catalog.lora_parameters_per_rank("local/gqa")
    # Head size 16: q and o map 64 ↔ 64, k and v 64 → 2 × 16; two layers. The tied unembedding
    # is still a Linear of its own to the adapter.
    assert per_rank == {
        "attn": 2 * (2 * (64 + 64) + 2 * (64 + 32)),
        "mlp": 2 * 3 * (64 + 96),
        "unembed": 64 + 1024,
    }
    for flags in PART_CHOICES:
        assert _allocated(engine, "local/gqa", 5, flags) == _published(per_rank, 5, flags), flags
