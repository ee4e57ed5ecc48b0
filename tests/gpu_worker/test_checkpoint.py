"""Save/load round trips, PEFT-compatible adapter exports and merged Hugging Face exports."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.protocol import AdamParams, Datum, LoraSpec
from tests.gpu_worker.helpers import TINY, next_token_logprobs, rng_tokens, training_run

pytestmark = pytest.mark.unit

ADAM = AdamParams(
    learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0
)


def batch(seed: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    return [
        Datum(
            rng_tokens(rng, 16),
            {"target_tokens": rng_tokens(rng, 16), "weights": np.ones(16, np.float32)},
        )
        for _ in range(3)
    ]


def log_softmax(logits_TV: torch.Tensor) -> np.ndarray:
    """(T-1, V): the reference model's distribution after each token but the last."""
    return torch.log_softmax(logits_TV[:-1].float(), dim=-1).numpy()


def train(engine, run: str, steps: range) -> list[float]:
    losses = []
    for s in steps:
        losses.append(engine.forward_backward(run, batch(s)).metrics["loss:sum"])
        engine.optim_step(run, ADAM)
    return losses


def test_save_load_with_optimizer_reproduces_next_step(engine, tmp_path):
    engine.create_run("ck-a", TINY, LoraSpec(rank=4, seed=3))
    try:
        train(engine, "ck-a", range(3))
        engine.save_state("ck-a", tmp_path / "state", include_optimizer=True)
        uninterrupted = train(engine, "ck-a", range(3, 5))
        engine.load_state("ck-b", tmp_path / "state", include_optimizer=True)
        resumed = train(engine, "ck-b", range(3, 5))
        np.testing.assert_allclose(resumed, uninterrupted, rtol=1e-6)
        engine.load_state("ck-c", tmp_path / "state", include_optimizer=False)
        fresh_moments = train(engine, "ck-c", range(3, 5))
        assert fresh_moments[1] != pytest.approx(uninterrupted[1], rel=1e-6)
        assert engine.steps("ck-b") == 5
    finally:
        for rid in ("ck-a", "ck-b", "ck-c"):
            engine.remove_run(rid)


def test_exported_adapter_loads_in_peft_with_same_logits(engine, tmp_path):
    from peft import PeftModel

    with training_run(engine, "peft-exp", LoraSpec(rank=8, alpha=16, seed=1)):
        train(engine, "peft-exp", range(2))
        engine.export_adapter("peft-exp", tmp_path / "adapter")
        assert (tmp_path / "adapter" / "adapter_config.json").exists()
        assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
        peft_model = PeftModel.from_pretrained(
            engine.catalog.load_model(TINY), str(tmp_path / "adapter")
        ).eval()
        tokens = list(range(5, 40))
        with torch.no_grad():
            want = log_softmax(peft_model(input_ids=torch.tensor([tokens])).logits[0])
        got = next_token_logprobs(engine, tokens, run_id="peft-exp")
        base = next_token_logprobs(engine, tokens, base_model=TINY)
        assert np.abs(got - base).max() > 1e-3  # the adapter does something
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_merged_export_loads_in_transformers_with_same_logits(engine, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with training_run(engine, "merged", LoraSpec(rank=4, seed=2)):
        train(engine, "merged", range(2))
        engine.export_merged("merged", tmp_path / "merged")
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
        tok = AutoTokenizer.from_pretrained(str(tmp_path / "merged"))
        assert tok.chat_template
        tokens = list(range(100, 130))
        with torch.no_grad():
            want = log_softmax(model(input_ids=torch.tensor([tokens])).logits[0])
        got = next_token_logprobs(engine, tokens, run_id="merged")
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_load_rejects_a_state_of_another_base_model(engine, tmp_path):
    from gpu_worker.protocol import UserInputError

    with training_run(engine, "other-base", LoraSpec(rank=2), base_model="treadle/tiny-qwen-1m"):
        engine.save_state("other-base", tmp_path / "q")
        with pytest.raises(UserInputError, match="trained on"):
            engine.load_state("x", tmp_path / "q", base_model=TINY)
        with pytest.raises(UserInputError, match="not a saved training state"):
            engine.load_state("x", tmp_path / "missing")
        assert "x" not in engine.run_ids()


@pytest.mark.parametrize("train_unembed", [True, False])
def test_merged_export_of_a_tied_embedding_model(tmp_path, train_unembed):
    from transformers import AutoModelForCausalLM

    from gpu_worker.catalog import ModelEntry
    from gpu_worker.engine import Engine, EngineSettings

    base = Engine().catalog.resolve(TINY)
    tied = ModelEntry(
        name="test/tied-1m",
        kind="tiny",
        tokenizer=base.tokenizer,
        config={**base.config, "tie_word_embeddings": True},
    )
    engine = Engine(EngineSettings(device="cpu", num_threads=1, catalog_entries=(tied,)))
    assert engine.catalog.load_model("test/tied-1m").config.tie_word_embeddings
    engine.create_run("t", "test/tied-1m", LoraSpec(rank=4, train_unembed=train_unembed))
    train(engine, "t", range(2))
    engine.export_merged("t", tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m")).eval()
    assert model.config.tie_word_embeddings is (not train_unembed)
    tokens = list(range(7, 30))
    with torch.no_grad():
        want = log_softmax(model(input_ids=torch.tensor([tokens])).logits[0])
    np.testing.assert_allclose(next_token_logprobs(engine, tokens, run_id="t"), want, atol=1e-4)
