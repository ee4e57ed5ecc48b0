"""Sampling: seeded reproducibility, stop reasons, sampled logprobs consistent with prompt logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.protocol import LoraSpec, SampleRequest, SamplingParams
from tests.gpu_worker.helpers import TINY, prompt_scores, sample, training_run

pytestmark = pytest.mark.unit

PROMPT = [5, 17, 300, 42, 8]


@pytest.fixture(scope="module")
def run(engine):
    with training_run(
        engine, "sampler", LoraSpec(rank=4, seed=9), randomize_seed=10, std=0.2
    ) as run_id:
        yield run_id


def sample_three(engine, run, **kw):
    params = SamplingParams(**{"max_tokens": 12, "seed": 1, "stop": [], **kw})
    return sample(engine, SampleRequest(prompt=PROMPT, params=params, num_samples=3, run_id=run))


def test_fixed_seed_is_reproducible(engine, run):
    a, b = sample_three(engine, run), sample_three(engine, run)
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert len({tuple(s.tokens) for s in a.sequences}) > 1  # samples differ from each other
    c = sample_three(engine, run, seed=2)
    assert [s.tokens for s in c.sequences] != [s.tokens for s in a.sequences]
    assert a.usage.prefill_tokens == len(PROMPT) and a.usage.sampled_tokens == 36


def test_batched_requests_equal_one_at_a_time(engine, run):
    requests = [
        SampleRequest(
            prompt=PROMPT[: 2 + i],
            num_samples=2,
            run_id=run if i % 2 else None,
            base_model=TINY,
            params=SamplingParams(
                max_tokens=6, seed=i, stop=[], top_k=50, top_p=0.9, temperature=0.8
            ),
        )
        for i in range(4)
    ]
    batched = engine.sample_batch(requests)
    for req, res in zip(requests, batched, strict=True):
        alone = sample(engine, req)
        assert [s.tokens for s in res.sequences] == [s.tokens for s in alone.sequences]
        for s, t in zip(res.sequences, alone.sequences, strict=True):
            np.testing.assert_allclose(s.logprobs, t.logprobs, atol=5e-4)


def test_max_tokens_gives_length_and_stop_gives_stop(engine, run):
    greedy = sample_three(engine, run, temperature=0.0)
    seq = greedy.sequences[0]
    assert seq.stop_reason == "length" and len(seq.tokens) == 12
    assert all(s.tokens == seq.tokens for s in greedy.sequences)  # greedy ignores the seed
    stop_id = seq.tokens[3]
    first = seq.tokens.index(stop_id)
    stopped = sample_three(engine, run, temperature=0.0, stop=[stop_id]).sequences[0]
    assert stopped.stop_reason == "stop" and stopped.tokens == seq.tokens[: first + 1]

    tok = engine.tokenizer(TINY)
    text = tok.decode(seq.tokens)
    target = tok.decode(seq.tokens[:5])
    stop_str = target[-2:] if len(target.strip()) >= 2 else target
    by_string = sample_three(engine, run, temperature=0.0, stop=[stop_str]).sequences[0]
    assert by_string.stop_reason == "stop"
    assert stop_str in tok.decode(by_string.tokens)
    assert stop_str not in tok.decode(by_string.tokens[:-1])
    assert text.startswith(tok.decode(by_string.tokens))


def test_sampled_logprobs_equal_prompt_logprobs(engine, run):
    res = sample_three(engine, run, temperature=1.0)
    for seq in res.sequences:
        full = prompt_scores(engine, PROMPT + seq.tokens, run_id=run).prompt_logprobs
        assert full is not None and np.isnan(full[0])
        np.testing.assert_allclose(seq.logprobs, full[len(PROMPT) :], atol=1e-4)


def test_prompt_logprobs_and_topk(engine, run):
    res = sample(
        engine,
        SampleRequest(
            prompt=PROMPT,
            run_id=run,
            prompt_logprobs=True,
            topk_prompt_logprobs=3,
            params=SamplingParams(max_tokens=1, seed=0),
        ),
    )
    lp = res.prompt_logprobs
    assert lp is not None and lp.shape == (len(PROMPT),) and np.isnan(lp[0])
    ids, vals = res.topk_prompt_logprobs
    assert ids.shape == vals.shape == (len(PROMPT), 3)
    assert np.all(vals[1:, 0] >= lp[1:] - 1e-6)
    assert np.all(np.diff(vals[1:], axis=1) <= 0)


def test_alias_serves_a_tiny_model(engine):
    res = sample(
        engine,
        SampleRequest(
            prompt=PROMPT, base_model="Qwen/Qwen3-8B", params=SamplingParams(max_tokens=2, seed=0)
        ),
    )
    assert len(res.sequences[0].tokens) <= 2
