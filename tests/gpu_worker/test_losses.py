"""Each loss's value, per-token logprobs and LoRA gradients against the plain-PyTorch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.protocol import Datum, LoraSpec
from tests.gpu_worker.helpers import TINY, VOCAB, adapter_grads, forward, rng_tokens, training_run
from tests.gpu_worker.reference import datum_loss, hooked_lora, target_logprobs
from treadle.types import TensorData

pytestmark = pytest.mark.unit

RL_LOSSES = ["importance_sampling", "ppo", "cispo", "dro", "gspo"]
CONFIGS = {"dro": {"beta": 0.3}, "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}}


def make_data(loss_fn: str, seed: int, k: int = 0) -> list[Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for n in (7, 12, 3):
        tokens = rng_tokens(rng, n)
        if loss_fn == "cross_entropy":
            shape = (n, k) if k else (n,)
            target = rng.integers(0, VOCAB, shape)
            weights = rng.normal(size=shape).astype(np.float32)  # negative weights allowed
            if k:
                weights[rng.random(shape) < 0.4] = 0.0
            data.append(Datum(tokens, {"target_tokens": target, "weights": weights}))
            continue
        inputs = {
            "target_tokens": rng.integers(0, VOCAB, n),
            # around the tiny model's ~log(1/1024) so ratios straddle the clip range
            "logprobs": (np.log(1 / VOCAB) + rng.normal(scale=0.4, size=n)).astype(np.float32),
            "advantages": rng.normal(size=n).astype(np.float32),
        }
        if loss_fn == "gspo":
            inputs["sequence_ratio_mask"] = (rng.random(n) < 0.7).astype(np.float32)
        data.append(Datum(tokens, inputs))
    return data


def reference(
    engine, run_id: str, loss_fn: str, data: list[Datum], config: dict, model: str = TINY
):
    """Loss, per-datum logprobs and grads from a fresh plain model with hooked LoRA."""
    base = engine.catalog.load_model(model)
    adapter = engine.adapter(run_id)
    leaves = {
        name: (a.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True))
        for name, (a, b) in adapter.weights.items()
    }
    total = torch.zeros(())
    logps = []
    with hooked_lora(base, leaves, adapter.scale):
        for d in data:
            logp = target_logprobs(base, np.asarray(d.tokens), d.loss_fn_inputs["target_tokens"])
            logps.append(logp.detach().numpy())
            total = total + datum_loss(loss_fn, logp, d.loss_fn_inputs, config)
    total.backward()
    grads = {}
    for name, (a, b) in leaves.items():
        grads[f"{name}.A"], grads[f"{name}.B"] = a.grad, b.grad
    return float(total.detach()), logps, grads


def assert_grads_close(got: dict, want: dict, atol: float = 2e-5) -> None:
    assert got.keys() == want.keys()
    scale = max(float(w.abs().max()) for w in want.values())
    assert scale > 0
    for key in want:
        torch.testing.assert_close(
            got[key],
            want[key],
            atol=atol * max(scale, 1.0),
            rtol=1e-3,
            msg=lambda m, key=key: f"{key}: {m}",
        )


@pytest.mark.parametrize("loss_fn", ["cross_entropy", *RL_LOSSES])
def test_loss_matches_reference(engine, loss_fn):
    run = f"loss-{loss_fn}"
    with training_run(engine, run, LoraSpec(rank=4, seed=1), randomize_seed=2):
        data = make_data(loss_fn, seed=3)
        config = CONFIGS.get(loss_fn, {})
        result = engine.forward_backward(run, data, loss_fn, config)
        ref_loss, ref_logps, ref_grads = reference(engine, run, loss_fn, data, config)
        assert result.metrics["loss:sum"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-4)
        for out, want in zip(result.loss_fn_outputs, ref_logps, strict=True):
            np.testing.assert_allclose(out["logprobs"], want, atol=1e-4)
        assert_grads_close(adapter_grads(engine, run), ref_grads)
        assert result.usage.trained_tokens == 7 + 12 + 3


@pytest.mark.parametrize("sparse", [False, True])
def test_top_k_cross_entropy_dense_and_csr(engine, sparse):
    run = f"topk-{sparse}"
    with training_run(engine, run, LoraSpec(rank=2, seed=5), randomize_seed=6):
        data = make_data("cross_entropy", seed=7, k=4)
        sent = data
        if sparse:  # what the tinker SDK sends for 2-D tensors: CSR with pad value 0
            # decoded as the scheduler decodes every wire tensor, by TensorData.to_numpy()
            sent = []
            for d in data:
                new = {}
                for key, dense in d.loss_fn_inputs.items():
                    rows, cols = np.nonzero(dense)
                    counts = np.bincount(rows, minlength=dense.shape[0])
                    csr = TensorData(
                        data=dense[rows, cols].tolist(),
                        dtype="float32" if dense.dtype.kind == "f" else "int64",
                        shape=list(dense.shape),
                        sparse_crow_indices=[0, *np.cumsum(counts).tolist()],
                        sparse_col_indices=cols.tolist(),
                    )
                    decoded = csr.to_numpy()
                    assert decoded.dtype == dense.dtype
                    np.testing.assert_array_equal(decoded, dense)
                    new[key] = decoded
                sent.append(Datum(d.tokens, new))
        result = engine.forward_backward(run, sent, "cross_entropy")
        ref_data = [Datum(d.tokens, dict(d.loss_fn_inputs)) for d in sent]
        ref_loss, ref_logps, ref_grads = reference(engine, run, "cross_entropy", ref_data, {})
        assert result.metrics["loss:sum"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-4)
        for out, want in zip(result.loss_fn_outputs, ref_logps, strict=True):
            assert out["logprobs"].shape == want.shape
            np.testing.assert_allclose(out["logprobs"], want, atol=1e-4)
        assert_grads_close(adapter_grads(engine, run), ref_grads)


def test_gradients_accumulate_across_calls(engine):
    run = "accumulate"
    with training_run(engine, run, LoraSpec(rank=4, seed=1), randomize_seed=2):
        data = make_data("cross_entropy", seed=11)
        engine.forward_backward(run, data[:1])
        engine.forward_backward(run, data[1:])
        _, _, ref_grads = reference(engine, run, "cross_entropy", data, {})
        assert_grads_close(adapter_grads(engine, run), ref_grads)


def test_forward_computes_without_gradients(engine):
    run = "forward-only"
    with training_run(engine, run, LoraSpec(rank=4)):
        data = make_data("cross_entropy", seed=12)
        fwd = forward(engine, run, data)
        assert all(p.grad is None for p in engine.adapter(run).parameters())
        fb = engine.forward_backward(run, data)
        assert fwd.metrics["loss:sum"] == pytest.approx(fb.metrics["loss:sum"], rel=1e-6)


def test_qwen2_architecture_matches_reference(engine):
    """q/k/v biases (Qwen2) go through the same LoRA layer."""
    run = "qwen-ref"
    with training_run(
        engine, run, LoraSpec(rank=3, seed=1), base_model="treadle/tiny-qwen-1m", randomize_seed=4
    ):
        data = make_data("ppo", seed=5)
        result = engine.forward_backward(run, data, "ppo")
        ref_loss, ref_logps, ref_grads = reference(
            engine, run, "ppo", data, {}, model="treadle/tiny-qwen-1m"
        )
        assert result.metrics["loss:sum"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-4)
        for out, want in zip(result.loss_fn_outputs, ref_logps, strict=True):
            np.testing.assert_allclose(out["logprobs"], want, atol=1e-4)
        assert_grads_close(adapter_grads(engine, run), ref_grads)


def _with_thresholds(data: list[Datum]) -> list[Datum]:
    """Datum 0 sends one threshold pair, datum 1 one pair per token, datum 2 none."""
    rng = np.random.default_rng(5)
    out = []
    for i, d in enumerate(data):
        inputs = dict(d.loss_fn_inputs)
        n = len(d.tokens)
        if i == 0:
            inputs["clip_low_threshold"] = np.array([0.97], dtype=np.float32)
            inputs["clip_high_threshold"] = np.array([1.02], dtype=np.float32)
        elif i == 1:
            inputs["clip_low_threshold"] = rng.uniform(0.5, 1.0, n).astype(np.float32)
            inputs["clip_high_threshold"] = rng.uniform(1.0, 1.5, n).astype(np.float32)
        out.append(Datum(d.tokens, inputs))
    return out


@pytest.mark.parametrize("loss_fn", ["ppo", "cispo", "gspo"])
def test_per_datum_clip_thresholds_override_the_config(engine, loss_fn):
    run = f"clip-{loss_fn}"
    with training_run(engine, run, LoraSpec(rank=4, seed=1), randomize_seed=2):
        plain = make_data(loss_fn, seed=3)
        data = _with_thresholds(plain)
        config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
        baseline = forward(engine, run, plain, loss_fn, config)
        result = engine.forward_backward(run, data, loss_fn, config)
        ref_loss, _, ref_grads = reference(engine, run, loss_fn, data, config)
        assert result.metrics["loss:sum"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-4)
        assert_grads_close(adapter_grads(engine, run), ref_grads)
        # The thresholds matter: the same datums under the config's thresholds score differently.
        assert abs(baseline.metrics["loss:sum"] - ref_loss) > 1e-3
        # Datum 2 sent none, so it keeps the config's thresholds exactly.
        np.testing.assert_allclose(
            result.loss_fn_outputs[2]["elementwise_loss"],
            baseline.loss_fn_outputs[2]["elementwise_loss"],
            atol=1e-6,
        )


def test_gspo_without_a_mask_uses_the_positions_with_nonzero_advantages(engine):
    run = "gspo-default-mask"
    with training_run(engine, run, LoraSpec(rank=4, seed=1), randomize_seed=2):
        data = []
        for d in make_data("gspo", seed=4):
            inputs = {k: v for k, v in d.loss_fn_inputs.items() if k != "sequence_ratio_mask"}
            adv = inputs["advantages"].copy()
            adv[: len(adv) // 2] = 0.0  # a prompt, as the cookbook's RL data has it
            inputs["advantages"] = adv
            data.append(Datum(d.tokens, inputs))
        result = engine.forward_backward(run, data, "gspo", {})
        ref_loss, _, ref_grads = reference(engine, run, "gspo", data, {})
        assert result.metrics["loss:sum"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-4)
        assert_grads_close(adapter_grads(engine, run), ref_grads)
        # An all-ones mask (prompt included) gives a different sequence ratio, so a different loss.
        ones = [
            Datum(
                d.tokens,
                {**d.loss_fn_inputs, "sequence_ratio_mask": np.ones(len(d.tokens), np.float32)},
            )
            for d in data
        ]
        other = forward(engine, run, ones, "gspo", {})
        assert abs(other.metrics["loss:sum"] - ref_loss) > 1e-4


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("clip_low_threshold", np.array([0.5, 0.6], np.float32), "shape"),
        ("clip_low_threshold", np.array([1.5], np.float32), "0 ≤ clip_low_threshold ≤ 1"),
        ("clip_high_threshold", np.array([np.nan], np.float32), "finite"),
    ],
)
def test_bad_clip_thresholds_are_user_errors(engine, key, value, message):
    from gpu_worker.protocol import UserInputError
    from gpu_worker.validation import check_datums

    data = make_data("ppo", seed=3)
    data[0] = Datum(data[0].tokens, {**data[0].loss_fn_inputs, key: value})
    with pytest.raises(UserInputError, match=message):
        check_datums(data, "ppo", VOCAB, 64, {})
    with pytest.raises(UserInputError, match="not used by importance_sampling"):
        check_datums(data, "importance_sampling", VOCAB, 64, {})
