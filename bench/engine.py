"""Engine benchmarks on CPU or GPU; prints one JSON object.

Measures, on a built-in tiny model (default the ~10M one):
1. training: tokens/s of Engine.forward_backward + optim_step vs the same work done in-process
   with plain PEFT + torch.optim.AdamW (same targets, rank, batch, precision);
2. cross-run batching: aggregate tokens/s of 8 runs with mixed ranks in one
   forward_backward_batch vs the same runs one after another;
3. sampling: sampled tokens/s of 16 concurrent requests batched vs one at a time;
4. memory: resident-set growth per added (trained) run vs its adapter + AdamW state size.

Run: `python bench/engine.py --threads 2` (add `--precision bf16-autocast` for AMX/bf16,
`--quick` for a fast smoke run). Timings are medians over repeats after one warm-up; the JSON
also records the share of the machine other processes used while measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gpu_worker.engine import Engine, EngineSettings
from gpu_worker.protocol import (
    AdamParams,
    Datum,
    ForwardBackwardOp,
    LoraSpec,
    SampleRequest,
    SamplingParams,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAM = AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8)


def _cpu_busy() -> tuple[float, float]:
    """(total jiffies, jiffies of other processes) so far, from /proc."""
    try:
        stat, own_stat = Path("/proc/stat").read_text(), Path("/proc/self/stat").read_text()
        fields = [float(x) for x in stat.splitlines()[0].split()[1:]]
        total, idle = sum(fields), fields[3] + fields[4]
        own = own_stat.rsplit(")", 1)[1].split()
        mine = float(own[11]) + float(own[12])
        return total, (total - idle) - mine
    except OSError:
        return 0.0, 0.0


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median seconds per call after one warm-up, and other processes' CPU share meanwhile."""
    fn()
    times = []
    t0, o0 = _cpu_busy()
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    t1, o1 = _cpu_busy()
    other = (o1 - o0) / (t1 - t0) if t1 > t0 else 0.0
    return statistics.median(times), round(other, 3)


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def ce_batch(rng: np.random.Generator, vocab: int, rows: int, length: int) -> list[Datum]:
    return [
        Datum(
            rng.integers(0, vocab, length),
            {
                "target_tokens": rng.integers(0, vocab, length),
                "weights": np.ones(length, np.float32),
            },
        )
        for _ in range(rows)
    ]


def bench_training(
    engine: Engine, model: str, rows: int, length: int, rank: int, repeats: int
) -> dict:
    from peft import LoraConfig, get_peft_model

    vocab = engine.catalog.info(model).vocab_size
    data = ce_batch(np.random.default_rng(0), vocab, rows, length)
    spec = LoraSpec(rank=rank, alpha=rank, train_unembed=False)
    engine.create_run("bench-train", model, spec)

    def engine_step() -> None:
        engine.forward_backward("bench-train", data)
        engine.optim_step("bench-train", ADAM)

    engine_s, engine_other = timed(engine_step, repeats)
    engine.remove_run("bench-train")

    peft_model = get_peft_model(
        engine.catalog.load_model(model).to(engine.device),
        LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=TARGETS),
    )
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params,
        lr=ADAM.learning_rate,
        betas=(ADAM.beta1, ADAM.beta2),
        eps=ADAM.eps,
        weight_decay=0.0,
    )
    x = torch.tensor(np.stack([d.tokens for d in data])).to(engine.device)
    y = torch.tensor(np.stack([d.loss_fn_inputs["target_tokens"] for d in data])).to(engine.device)
    autocast = (
        torch.autocast(engine.device.type, dtype=engine.autocast_dtype)
        if engine.autocast_dtype is not None
        else torch.autocast("cpu", enabled=False)
    )

    def peft_step() -> None:
        with autocast:
            logits = peft_model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), y.flatten(), reduction="sum"
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    peft_s, peft_other = timed(peft_step, repeats)
    tokens = rows * length
    return {
        "model": model,
        "batch": f"{rows}x{length}",
        "rank": rank,
        "engine_tokens_per_s": round(tokens / engine_s, 1),
        "peft_tokens_per_s": round(tokens / peft_s, 1),
        "ratio_engine_over_peft": round(peft_s / engine_s, 3),
        "goal": 0.95,
        "other_load": [engine_other, peft_other],
    }


def bench_batching(engine: Engine, model: str, length: int, repeats: int) -> dict:
    ranks = (1, 4, 8, 16, 32, 64, 8, 32)
    vocab = engine.catalog.info(model).vocab_size
    rng = np.random.default_rng(1)
    ids = []
    for i, rank in enumerate(ranks):
        rid = f"bench-mix-{i}"
        engine.create_run(rid, model, LoraSpec(rank=rank, alpha=rank, seed=i))
        ids.append(rid)
    data = {rid: ce_batch(rng, vocab, 1, length) for rid in ids}

    def batched() -> None:
        engine.forward_backward_batch([ForwardBackwardOp(rid, data[rid]) for rid in ids])
        for rid in ids:
            engine.optim_step(rid, ADAM)

    def sequential() -> None:
        for rid in ids:
            engine.forward_backward(rid, data[rid])
            engine.optim_step(rid, ADAM)

    batched_s, b_other = timed(batched, repeats)
    seq_s, s_other = timed(sequential, repeats)
    for rid in ids:
        engine.remove_run(rid)
    tokens = len(ids) * length
    return {
        "model": model,
        "runs": len(ids),
        "ranks": list(ranks),
        "tokens_per_run": length,
        "batched_tokens_per_s": round(tokens / batched_s, 1),
        "sequential_tokens_per_s": round(tokens / seq_s, 1),
        "ratio_batched_over_sequential": round(seq_s / batched_s, 3),
        "goal": 1.3,
        "other_load": [b_other, s_other],
    }


def bench_sampling(engine: Engine, model: str, max_tokens: int, repeats: int) -> dict:
    vocab = engine.catalog.info(model).vocab_size
    rng = np.random.default_rng(2)
    ids = []
    for i in range(4):
        engine.create_run(f"bench-sample-{i}", model, LoraSpec(rank=16, seed=i))
        ids.append(f"bench-sample-{i}")
    requests = [
        SampleRequest(
            prompt=rng.integers(0, vocab, 16).tolist(),
            run_id=ids[i % 4],
            params=SamplingParams(max_tokens=max_tokens, seed=i, stop=[]),
        )
        for i in range(16)
    ]
    batched_s, b_other = timed(lambda: engine.sample_batch(requests), repeats)
    alone_s, a_other = timed(
        lambda: [engine.sample_batch([r]) for r in requests], max(1, repeats // 2)
    )
    for rid in ids:
        engine.remove_run(rid)
    tokens = 16 * max_tokens
    return {
        "model": model,
        "requests": 16,
        "max_tokens": max_tokens,
        "batched_tokens_per_s": round(tokens / batched_s, 1),
        "one_at_a_time_tokens_per_s": round(tokens / alone_s, 1),
        "ratio_batched_over_one_at_a_time": round(alone_s / batched_s, 3),
        "goal": 3.0,
        "other_load": [b_other, a_other],
    }


def bench_memory(engine: Engine, model: str, runs: int, rank: int) -> dict:
    vocab = engine.catalog.info(model).vocab_size
    data = ce_batch(np.random.default_rng(3), vocab, 1, 32)
    engine.create_run("bench-mem-warm", model, LoraSpec(rank=rank))
    engine.forward_backward("bench-mem-warm", data)
    engine.optim_step("bench-mem-warm", ADAM)
    before = rss_bytes()
    for i in range(runs):
        rid = f"bench-mem-{i}"
        engine.create_run(rid, model, LoraSpec(rank=rank, seed=i))
        engine.forward_backward(rid, data)
        engine.optim_step(rid, ADAM)
    growth = (rss_bytes() - before) / runs
    state = engine.run_memory_bytes("bench-mem-0")
    for i in range(runs):
        engine.remove_run(f"bench-mem-{i}")
    engine.remove_run("bench-mem-warm")
    return {
        "model": model,
        "rank": rank,
        "runs_added": runs,
        "rss_growth_per_run_mb": round(growth / 2**20, 2),
        "adapter_plus_adam_mb": round(state / 2**20, 2),
        "ratio_growth_over_state": round(growth / state, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="treadle/tiny-10m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small shapes, 2 repeats")
    parser.add_argument("--only", default="training,batching,sampling,memory")
    args = parser.parse_args()
    engine = Engine(
        EngineSettings(
            device=args.device,
            precision=args.precision,
            num_threads=args.threads,
            models=(args.model,),
        )
    )
    repeats = 2 if args.quick else args.repeats
    rows, length = (2, 64) if args.quick else (8, 256)
    only = set(args.only.split(","))
    report: dict = {
        "device": str(engine.device),
        "threads": torch.get_num_threads(),
        "precision": args.precision,
        "torch": torch.__version__,
    }
    if "memory" in only:  # first, before other benchmarks leave freed memory to reuse
        report["memory"] = bench_memory(engine, args.model, 4 if args.quick else 16, 32)
    if "training" in only:
        report["training"] = bench_training(engine, args.model, rows, length, 32, repeats)
    if "batching" in only:  # long sequences per run, then short RL-style ones
        report["batching"] = bench_batching(engine, args.model, 64 if args.quick else 256, repeats)
        report["batching_short"] = bench_batching(engine, args.model, 32, repeats)
    if "sampling" in only:
        report["sampling"] = bench_sampling(engine, args.model, 8 if args.quick else 32, repeats)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
