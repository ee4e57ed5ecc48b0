"""Sampling benchmark on CPU or GPU; prints one JSON object.

On a built-in tiny model (default the ~10M one) with 4 LoRA adapters (rank 16 on every
attention and MLP projection and the unembedding), requests of a 16-token prompt and
`--max-tokens` sampled tokens each (temperature 1, no early stop), cycling through the
adapters:
1. concurrent: tokens/s of 1, 16 and 64 requests sent in one `Engine.sample_batch`;
2. sequential: the same engine, the first `--sequential` requests of the set sent one
   `sample_batch` at a time (a rate, so a few requests suffice);
3. transformers: `generate` per request (the same first requests) on a PEFT model
   (`PeftModel.from_pretrained` of the engine's exported adapters on a fresh copy of the same
   base model, `set_adapter` per request), sampling the same number of tokens;
4. time to first token: the requests with max_tokens=1, all of them in one call, one alone,
   and one through `generate`;
5. arrivals: `--arrivals` requests arriving one every `interval` seconds (a quarter of one
   request's measured time alone, so arrivals overlap decoding), on the same engine, two ways
   in turn: continuous (each step first `sample_start`s every request that has arrived, so it
   joins the running loop) and batch at a time (when idle, start every request that has
   arrived and step until all of them finish: the steps of one `sample_batch`, the worker's
   former way, taken here one by one so that first tokens show). Per way: latency from
   arrival to finish (mean, p90), time from arrival to the first token (`sample_progress`
   after each step), tokens/s over the whole run; ratios are batch over continuous for
   times, continuous over batch for tokens/s (higher is better).

Run: `python bench/sampling.py [--device cuda] [--threads 1] [--arrivals 0]` (0 skips the
arrivals). Timings are medians over `--repeats` after one warm-up, the measurements of one
size taken in turn within each repeat so that a busy machine slows all of them alike;
`other_load` is the share of the machine other processes used meanwhile (see
bench/engine.py). Ratios are engine tokens/s over the baseline's (higher is better). The
arrivals run without a warm-up, on the engine the other measurements warmed, in simulated
time driven by the real clock.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.engine import _cpu_busy
from gpu_worker.engine import Engine, EngineSettings
from gpu_worker.protocol import LoraSpec, OpError, SampleRequest, SamplingParams

ADAPTERS = 4


def make_requests(vocab: int, n: int, max_tokens: int) -> list[SampleRequest]:
    rng = np.random.default_rng(7)
    return [
        SampleRequest(
            prompt=rng.integers(0, vocab, 16).tolist(),
            run_id=f"bench-sampling-{i % ADAPTERS}",
            params=SamplingParams(max_tokens=max_tokens, seed=i, stop=[]),
        )
        for i in range(n)
    ]


def peft_generate(engine: Engine, model: str, folder: Path) -> Callable[[SampleRequest], None]:
    """`generate(request)` on a PEFT model holding every benchmark adapter."""
    from peft import PeftModel

    base = engine.catalog.load_model(model).to(engine.device, dtype=engine.weight_dtype).eval()
    peft = PeftModel.from_pretrained(base, str(folder / "0"), adapter_name="a0")
    for i in range(1, ADAPTERS):
        peft.load_adapter(str(folder / str(i)), adapter_name=f"a{i}")

    @torch.no_grad()
    def generate(req: SampleRequest) -> None:
        assert req.run_id is not None
        peft.set_adapter(f"a{int(req.run_id.rsplit('-', 1)[1])}")
        n = req.params.max_tokens
        torch.manual_seed(req.params.seed or 0)
        peft.generate(
            input_ids=torch.tensor([req.prompt], device=engine.device),
            attention_mask=torch.ones((1, len(req.prompt)), dtype=torch.long, device=engine.device),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
        )

    return generate


def each(fn: Callable[[SampleRequest], None], requests: list[SampleRequest]) -> None:
    for request in requests:
        fn(request)


def interleaved(
    fns: dict[str, Callable[[], object]], repeats: int
) -> tuple[dict[str, float], float]:
    """Median seconds per call of each function, called in turn in every repeat (after one
    warm-up each) so that all of them see the same load, and other processes' CPU share."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    t0, o0 = _cpu_busy()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    t1, o1 = _cpu_busy()
    other = (o1 - o0) / (t1 - t0) if t1 > t0 else 0.0
    return {name: statistics.median(t) for name, t in times.items()}, round(other, 3)


def arrivals_run(
    engine: Engine, requests: list[SampleRequest], interval: float, continuous: bool
) -> dict[str, float]:
    """Request i arrives `i * interval` s after the start; continuous admits arrivals before
    every step, batch at a time only once every started request has finished. Seconds from
    arrival to first token and to finish, averaged, and tokens/s over the run."""
    n = len(requests)
    first: dict[int, float] = {}
    finish: dict[int, float] = {}
    started: set[int] = set()
    admitted = 0
    t0 = time.perf_counter()
    while len(finish) < n:
        now = time.perf_counter() - t0
        if continuous or engine.sampling == 0:
            while admitted < n and admitted * interval <= now:
                refused = engine.sample_start(f"arrival-{admitted}", requests[admitted])
                assert refused is None, refused
                started.add(admitted)
                admitted += 1
        if engine.sampling == 0:  # nothing arrived yet: wait for the next request
            time.sleep(max(0.0, admitted * interval - now))
            continue
        done = engine.sample_step()
        now = time.perf_counter() - t0
        for i in started:
            if i not in first and engine.sample_progress(f"arrival-{i}"):
                first[i] = now
        for key, outcome in done:
            assert not isinstance(outcome, OpError), outcome
            i = int(key.rsplit("-", 1)[1])
            first.setdefault(i, now)  # finished within the step that chose its first token
            finish[i] = now
            started.discard(i)
    latency = [finish[i] - i * interval for i in range(n)]
    tokens = sum(r.params.max_tokens for r in requests)
    return {
        "latency_s_mean": statistics.mean(latency),
        "latency_s_p90": float(np.percentile(latency, 90)),
        "ttft_s_mean": statistics.mean(first[i] - i * interval for i in range(n)),
        "tokens_per_s": tokens / max(finish.values()),
    }


def arrivals(
    engine: Engine, requests: list[SampleRequest], interval: float, repeats: int
) -> dict[str, object]:
    """Both ways of `arrivals_run` in turn in every repeat; medians, ratios, other load."""
    runs: dict[str, list[dict[str, float]]] = {"continuous": [], "batch_at_a_time": []}
    t0, o0 = _cpu_busy()
    for _ in range(repeats):
        for way, measured in runs.items():
            measured.append(arrivals_run(engine, requests, interval, way == "continuous"))
    t1, o1 = _cpu_busy()
    med = {
        way: {k: statistics.median(r[k] for r in measured) for k in measured[0]}
        for way, measured in runs.items()
    }
    cont, batch = med["continuous"], med["batch_at_a_time"]
    report: dict[str, object] = {"requests": len(requests), "interval_ms": round(interval * 1e3, 1)}
    for way, m in med.items():
        report[way] = {
            "latency_ms_mean": round(m["latency_s_mean"] * 1e3, 1),
            "latency_ms_p90": round(m["latency_s_p90"] * 1e3, 1),
            "ttft_ms_mean": round(m["ttft_s_mean"] * 1e3, 1),
            "tokens_per_s": round(m["tokens_per_s"], 1),
        }
    report["batch_over_continuous_latency_mean"] = round(
        batch["latency_s_mean"] / cont["latency_s_mean"], 2
    )
    report["batch_over_continuous_latency_p90"] = round(
        batch["latency_s_p90"] / cont["latency_s_p90"], 2
    )
    report["batch_over_continuous_ttft_mean"] = round(batch["ttft_s_mean"] / cont["ttft_s_mean"], 2)
    report["continuous_over_batch_tokens_per_s"] = round(
        cont["tokens_per_s"] / batch["tokens_per_s"], 2
    )
    report["other_load"] = round((o1 - o0) / (t1 - t0), 3) if t1 > t0 else 0.0
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="treadle/tiny-10m")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda when available")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--sizes", default="1,16,64", help="concurrent request counts")
    parser.add_argument(
        "--sequential", type=int, default=4, help="requests of each set timed one by one"
    )
    parser.add_argument(
        "--arrivals", type=int, default=32, help="requests arriving one by one (0: skip)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    engine = Engine(
        EngineSettings(
            device=args.device,
            precision=args.precision,
            num_threads=args.threads,
            models=(args.model,),
        )
    )
    vocab = engine.catalog.info(args.model).vocab_size
    gen = torch.Generator().manual_seed(0)
    for i in range(ADAPTERS):
        rid = f"bench-sampling-{i}"
        engine.create_run(rid, args.model, LoraSpec(rank=16, seed=i))
        with torch.no_grad():  # non-zero B, so the adapters change the tokens
            for _, b in engine.adapter(rid).weights.values():
                b.copy_(torch.randn(b.shape, generator=gen).to(b.device) * 0.02)
    sizes = [int(s) for s in args.sizes.split(",")]
    T = args.max_tokens
    report: dict = {
        "device": str(engine.device),
        "threads": torch.get_num_threads(),
        "precision": args.precision,
        "torch": torch.__version__,
        "model": args.model,
        "adapters": ADAPTERS,
        "prompt_tokens": 16,
        "max_tokens": T,
    }

    with tempfile.TemporaryDirectory() as tmp:
        for i in range(ADAPTERS):
            engine.export_adapter(f"bench-sampling-{i}", Path(tmp) / str(i))
        generate = peft_generate(engine, args.model, Path(tmp))

    def sample_alone(request: SampleRequest) -> None:
        engine.sample_batch([request])

    token_s: list[float] = []  # one request alone: seconds per sampled token, per size
    for n in sizes:
        requests = make_requests(vocab, n, T)
        alone = requests[: args.sequential]
        ones = [replace(r, params=replace(r.params, max_tokens=1)) for r in requests]
        times, other = interleaved(
            {
                "concurrent": functools.partial(engine.sample_batch, requests),
                "sequential": functools.partial(each, sample_alone, alone),
                "generate": functools.partial(each, generate, alone),
                "ttft_concurrent": functools.partial(engine.sample_batch, ones),
                "ttft_alone": functools.partial(engine.sample_batch, ones[:1]),
                "ttft_generate": functools.partial(generate, ones[0]),
            },
            args.repeats,
        )
        rate = n * T / times["concurrent"]
        seq_rate = len(alone) * T / times["sequential"]
        token_s.append(1 / seq_rate)
        hf_rate = len(alone) * T / times["generate"]
        report[f"concurrent_{n}"] = {
            "tokens_per_s": round(rate, 1),
            "sequential_tokens_per_s": round(seq_rate, 1),
            "transformers_generate_tokens_per_s": round(hf_rate, 1),
            "ratio_over_sequential": round(rate / seq_rate, 2),
            "ratio_over_transformers_generate": round(rate / hf_rate, 2),
            "ttft_ms_all_requests": round(times["ttft_concurrent"] * 1e3, 1),
            "ttft_ms_one_request_alone": round(times["ttft_alone"] * 1e3, 1),
            "ttft_ms_transformers_generate": round(times["ttft_generate"] * 1e3, 1),
            "other_load": other,
        }
    if args.arrivals > 0:
        interval = statistics.median(token_s) * T / 4
        print(f"arrivals: one every {interval * 1e3:.1f} ms", file=sys.stderr)
        report["arrivals"] = arrivals(
            engine, make_requests(vocab, args.arrivals, T), interval, args.repeats
        )
    report["goals"] = {
        "concurrent_64_over_sequential": 3.0,
        "concurrent_over_transformers_generate": 1.0,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
