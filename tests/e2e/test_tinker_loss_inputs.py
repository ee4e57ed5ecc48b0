"""Loss inputs and sampling seeds the tinker SDK sends, through a real server.

Per-datum clip thresholds and gspo without `sequence_ratio_mask` are checked against the
formulas of spec/tinker-wire.md §7, evaluated here in numpy on the logprobs the server
returns; seedless samples differ between calls while seeded ones repeat.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tinker
from tinker import types

from tests.scenarios import MODEL
from tests.server import LiveServer

pytestmark = pytest.mark.e2e

PROMPT = [11, 12, 13, 14]


@pytest.fixture
def service(live_server: LiveServer) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(
        base_url=live_server.base_url, api_key=live_server.make_tenant().key
    )
    yield client
    client.close("success").result(timeout=60)


def _rl_data(seed: int) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
    """(tokens, sampler logprobs, advantages) per datum; prompt positions carry zeros."""
    rng = np.random.default_rng(seed)
    out = []
    for n in (6, 9, 5):
        tokens = PROMPT + rng.integers(20, 200, n).tolist()
        m = len(tokens) - 1
        pad = len(PROMPT) - 1
        # Far from the model's logprobs in both directions, so ratios leave [0.8, 1.2].
        q = np.zeros(m, np.float32)
        q[pad:] = -7.0 + rng.normal(scale=1.0, size=m - pad)
        adv = np.zeros(m, np.float32)
        adv[pad:] = rng.choice([-1.0, 1.0], size=m - pad)
        out.append((tokens, q, adv))
    return out


def _datum(tokens: list[int], extra: dict[str, object]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], **extra},  # type: ignore[dict-item]
    )


def _ppo(logp: np.ndarray, q: np.ndarray, adv: np.ndarray, lo: object, hi: object) -> float:
    r = np.exp(logp - q)
    return float(-np.minimum(r * adv, np.clip(r, lo, hi) * adv).sum())  # type: ignore[call-overload]


def test_per_datum_clip_thresholds_replace_the_config_for_their_datum(
    service: tinker.ServiceClient,
) -> None:
    trainer = service.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
    rows = _rl_data(0)
    per_token_lo = np.linspace(0.3, 0.9, len(rows[1][0]) - 1).astype(np.float32)
    thresholds: list[dict[str, object]] = [
        {  # one value for the datum, as a 0-d and a (1,) tensor
            "clip_low_threshold": types.TensorData.from_numpy(np.array(0.5, np.float32)),
            "clip_high_threshold": [3.0],
        },
        {"clip_low_threshold": per_token_lo.tolist(), "clip_high_threshold": [1.05]},
        {},  # keeps loss_fn_config's
    ]
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    data = [
        _datum(t, {"logprobs": q.tolist(), "advantages": a.tolist(), **th})
        for (t, q, a), th in zip(rows, thresholds, strict=True)
    ]
    out = trainer.forward(data, "ppo", loss_fn_config=config).result()
    logps = [np.asarray(o["logprobs"].tolist(), np.float64) for o in out.loss_fn_outputs]
    lows: list[object] = [0.5, per_token_lo, 0.9]
    highs: list[object] = [3.0, 1.05, 1.1]
    want = sum(
        _ppo(lp, q, a, lo, hi)
        for lp, (_, q, a), lo, hi in zip(logps, rows, lows, highs, strict=True)
    )
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-4)
    config_only = sum(_ppo(lp, q, a, 0.9, 1.1) for lp, (_, q, a) in zip(logps, rows, strict=True))
    assert abs(config_only - want) > 1e-2  # the thresholds did change the loss

    with pytest.raises(tinker.RequestFailedError, match=r"one value \(1,\) or one per token"):
        bad = [_datum(rows[0][0], {"logprobs": rows[0][1].tolist(),
                                   "advantages": rows[0][2].tolist(),
                                   "clip_low_threshold": [0.5, 0.5]})]  # fmt: skip
        trainer.forward(bad, "ppo").result()


def test_gspo_without_a_mask_takes_the_ratio_over_nonzero_advantages(
    service: tinker.ServiceClient,
) -> None:
    trainer = service.create_lora_training_client(base_model=MODEL, rank=4, seed=2).result()
    rows = _rl_data(1)
    data = [_datum(t, {"logprobs": q.tolist(), "advantages": a.tolist()}) for t, q, a in rows]
    out = trainer.forward_backward(data, "gspo").result()
    want = 0.0
    for o, (_, q, a) in zip(out.loss_fn_outputs, rows, strict=True):
        logp = np.asarray(o["logprobs"].tolist(), np.float64)
        s = np.exp((logp - q)[a != 0].mean())
        want += float(-np.minimum(s * a, np.clip(s, 0.8, 1.2) * a).sum())
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-4)


def test_seedless_samples_differ_and_seeded_samples_repeat(
    service: tinker.ServiceClient,
) -> None:
    sampler = service.create_sampling_client(base_model=MODEL).result()
    prompt = types.ModelInput.from_ints(PROMPT)

    def draw(seed: int | None) -> list[list[int]]:
        params = types.SamplingParams(max_tokens=12, temperature=1.0, seed=seed)
        result = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
        return [list(s.tokens) for s in result.sequences]

    assert draw(7) == draw(7)
    seedless = [draw(None) for _ in range(3)]
    # Twelve tokens at temperature 1 over the model's vocabulary: equal draws mean a fixed seed.
    assert len({str(d) for d in seedless}) == 3, seedless
    assert draw(0) not in seedless
