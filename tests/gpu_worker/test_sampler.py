"""The decode loop itself: batch independence, jobs joining a running loop, stop strings across
token boundaries, prompt logprobs from the prefill, and the distribution of the seeded choice."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from gpu_worker.catalog import Catalog
from gpu_worker.lora import LoraAdapter, adapter_shapes, inject
from gpu_worker.protocol import LoraSpec, SampleRequest, SamplingParams
from gpu_worker.sampling import Job, Sampler, StopText
from gpu_worker.token_choice import RowParams, choose, row_key
from tests.gpu_worker.helpers import TINY, sample, training_run
from tests.gpu_worker.reference import hooked_lora

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
DEVICE = torch.device(os.environ.get("TREADLE_TEST_DEVICE", "cpu"))  # as the engine fixture

PARAMS = [
    SamplingParams(max_tokens=10, seed=1, stop=[], temperature=1.0),
    SamplingParams(max_tokens=7, seed=2, stop=[], temperature=0.7, top_k=5),
    SamplingParams(max_tokens=12, seed=3, stop=[], temperature=1.3, top_p=0.8),
    SamplingParams(max_tokens=9, seed=4, stop=[], temperature=0.0),
    SamplingParams(max_tokens=11, seed=5, stop=[], temperature=0.9, top_k=40, top_p=0.9),
]


@pytest.fixture(scope="module")
def parts():
    """A model, its LoRA context, a tokenizer and two random adapters, built without an Engine."""
    from transformers import AutoTokenizer

    catalog = Catalog([], {}, None)
    model = catalog.load_model(TINY).to(DEVICE)
    ctx, wrapped = inject(model)
    tokenizer = AutoTokenizer.from_pretrained(str(catalog.tokenizer_dir(TINY)))
    adapters = []
    for seed, rank in ((1, 4), (2, 8)):
        spec = LoraSpec(rank=rank, seed=seed)
        adapter = LoraAdapter(spec, adapter_shapes(wrapped, spec), DEVICE)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, b in adapter.weights.values():
                b.copy_(torch.randn(b.shape, generator=gen).to(DEVICE) * 0.2)
        adapters.append(adapter)
    return model, ctx, tokenizer, adapters


def _job(i: int, adapters: list[LoraAdapter]) -> Job:
    prompt = [(7 * i + 3 * k) % 1000 + 1 for k in range(3 + 2 * i)]
    adapter = [None, adapters[0], adapters[1]][i % 3]
    return Job(prompt, PARAMS[i % len(PARAMS)], 2, adapter, set(), [])


def _run(parts, jobs: list[Job], join_at: dict[int, list[Job]] | None = None) -> None:
    model, ctx, tokenizer, _ = parts
    sampler = Sampler(model, ctx, tokenizer, DEVICE, None)
    for job in jobs:
        sampler.add(job)
    step = 0
    while not sampler.idle or (join_at and step <= max(join_at)):
        for job in (join_at or {}).get(step, []):
            sampler.add(job)
        sampler.step()
        step += 1


def _tokens(job: Job) -> list[list[int]]:
    return sorted(s.tokens for s in job.sequences)


def test_a_row_samples_the_same_tokens_with_or_without_other_rows(parts):
    adapters = parts[3]
    together = [_job(i, adapters) for i in range(5)]
    _run(parts, together)
    for i, job in enumerate(together):
        alone = _job(i, adapters)
        _run(parts, [alone])
        assert _tokens(job) == _tokens(alone)
        assert len(job.sequences[0].tokens) == job.params.max_tokens
        by_tokens = {tuple(s.tokens): s.logprobs for s in alone.sequences}
        for s in job.sequences:
            np.testing.assert_allclose(s.logprobs, by_tokens[tuple(s.tokens)], atol=1e-4)
    # different seeds and params really give different streams
    assert len({tuple(t) for job in together for t in _tokens(job)}) > 5


def test_jobs_added_to_a_running_loop_sample_as_if_alone(parts):
    adapters = parts[3]
    first = [_job(0, adapters), _job(1, adapters)]
    late = {2: [_job(2, adapters)], 4: [_job(3, adapters), _job(4, adapters)]}
    _run(parts, first, join_at=late)
    for i, job in enumerate(first + late[2] + late[4]):
        alone = _job(i, adapters)
        _run(parts, [alone])
        assert _tokens(job) == _tokens(alone), f"job {i}"


@pytest.mark.parametrize("shares", [[[0, 2], [1, 3]], [[3], [0, 1, 2]], [[], [0, 1, 2, 3]]])
def test_a_requests_samples_split_by_index_over_loops_equal_one_loop(parts, shares):
    """What two ranks of a worker group do: each samples a share of the request's sample
    indices on its own replica of the weights."""
    adapters = parts[3]
    params = SamplingParams(max_tokens=12, seed=9, stop=[], temperature=0.9, top_p=0.95)
    whole = [Job([5, 17, 300, 41], params, 4, a, set(), []) for a in (None, adapters[1])]
    _run(parts, whole)
    for job in whole:
        by_index: dict[int, list[int]] = {}
        for share in shares:
            if not share:
                continue
            part = Job(job.prompt, params, len(share), job.adapter, set(), [], indices=share)
            _run(parts, [part])
            by_index.update(zip(share, (s.tokens for s in part.sequences), strict=True))
        assert [by_index[i] for i in range(4)] == [s.tokens for s in job.sequences]
        assert len({tuple(s.tokens) for s in job.sequences}) > 1  # the samples do differ


def test_stop_string_spanning_a_token_boundary(parts):
    tokenizer = parts[2]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, stop=[])
    free = Job([5, 17, 300, 42, 8], greedy, 1, None, set(), [])
    _run(parts, [free])
    tokens = free.sequences[0].tokens
    pieces = [tokenizer.decode([t]) for t in tokens]
    # the last character of one token and the first of the next, at the first boundary where
    # that pair appears nowhere earlier in the text
    for k in range(1, len(tokens)):
        if pieces[k - 1] and pieces[k]:
            stop = pieces[k - 1][-1] + pieces[k][0]
            if stop not in tokenizer.decode(tokens[:k]):
                break
    else:
        pytest.fail(f"no token boundary to stop at in {pieces}")
    params = SamplingParams(max_tokens=16, temperature=0.0, stop=[stop])
    stopped = Job([5, 17, 300, 42, 8], params, 1, None, set(), [stop])
    _run(parts, [stopped])
    seq = stopped.sequences[0]
    assert seq.stop_reason == "stop" and seq.tokens == tokens[: k + 1]


def test_prompt_logprobs_from_the_prefill_equal_a_separate_forward(engine):
    prompts = [[5, 17, 300, 42, 8, 9, 10], [3, 4], [900, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    with training_run(
        engine, "prefill-scores", LoraSpec(rank=4, seed=3, train_unembed=True), randomize_seed=4
    ) as run:
        requests = [
            SampleRequest(
                prompt=p,
                params=SamplingParams(max_tokens=3, seed=i),
                run_id=run if i != 1 else None,
                base_model=TINY,
                prompt_logprobs=i != 2,
                topk_prompt_logprobs=4 if i != 0 else 0,
            )
            for i, p in enumerate(prompts)
        ]
        results = engine.sample_batch(requests)
        adapter = engine.adapter(run)
        base = engine.base_module(TINY)
        for req, res in zip(requests, results, strict=True):
            weights = adapter.weights if req.run_id else {}
            with torch.no_grad(), hooked_lora(base, weights, adapter.scale):
                logits = base(input_ids=torch.tensor([req.prompt], device=engine.device)).logits
            logp_PV = torch.log_softmax(logits[0, :-1].float().cpu(), dim=-1)
            want = logp_PV.gather(1, torch.tensor(req.prompt[1:])[:, None])[:, 0].numpy()
            if req.prompt_logprobs:
                assert np.isnan(res.prompt_logprobs[0])
                np.testing.assert_allclose(res.prompt_logprobs[1:], want, atol=1e-5)
            else:
                assert res.prompt_logprobs is None
            if req.topk_prompt_logprobs:
                ids, vals = res.topk_prompt_logprobs
                best = torch.topk(logp_PV, 4, dim=-1)
                np.testing.assert_allclose(vals[1:], best.values.numpy(), atol=1e-5)
                assert (ids[1:] == best.indices.numpy()).all()
            else:
                assert res.topk_prompt_logprobs is None


def test_one_request_alone_still_samples_through_the_engine(engine):
    res = sample(
        engine,
        SampleRequest(prompt=[1, 2, 3], base_model=TINY, params=SamplingParams(max_tokens=4)),
    )
    assert len(res.sequences) == 1 and 1 <= len(res.sequences[0].tokens) <= 4


@pytest.mark.parametrize(
    ("top_k", "top_p", "temperature"), [(-1, 1.0, 1.0), (3, 1.0, 0.5), (-1, 0.7, 2.0)]
)
def test_seeded_choice_draws_from_the_filtered_distribution(top_k, top_p, temperature):
    logits_V = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0])
    n = 20000
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * n
    rows = RowParams.of(params, [row_key(11, i) for i in range(n)], CPU)
    chosen = choose(logits_V.expand(n, -1), rows, torch.zeros(n, dtype=torch.long))
    freq = np.bincount(chosen.numpy(), minlength=6) / n

    probs = torch.softmax(logits_V / temperature, dim=-1)
    if top_k > 0:
        probs[top_k:] = 0  # logits are sorted
    probs = probs / probs.sum()
    before = torch.cumsum(probs, 0) - probs
    probs[before >= top_p] = 0
    probs = (probs / probs.sum()).numpy()
    np.testing.assert_allclose(freq, probs, atol=0.015)
    # a step later the same rows draw again, differently
    again = choose(logits_V.expand(n, -1), rows, torch.ones(n, dtype=torch.long))
    assert (again != chosen).any()


@pytest.mark.parametrize(
    ("text", "stop", "stops_at"),
    [("ab😀cd", "😀c", "c"), ("ab😀cd", "b😀", "😀"), ("xé€y", "€", "€"), ("abcabd", "abd", "d")],
)
def test_stop_text_finds_strings_across_tokens_and_split_characters(parts, text, stop, stops_at):
    tokenizer = parts[2]
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop_text = StopText(tokenizer, [stop])
    hits = [k for k in range(1, len(ids) + 1) if stop_text.push(ids[:k])]
    # it fires once, on the token that completes the stop string's last character
    (k,) = hits
    assert stop in tokenizer.decode(ids[:k]) and stop not in tokenizer.decode(ids[: k - 1])
    assert tokenizer.decode(ids[:k]).endswith(stops_at)
