"""A worker group against one engine on the same total batch: training throughput, and the base
model's memory per rank.

Prints one JSON object:
- `single`: tokens/s of forward_backward + optim_step on one engine (on CPU with as many
  threads as the group has ranks, so both use the same cores), and its base weights' bytes;
- `replicated`: the same steps on a group of `--ranks` ranks that each hold the whole base
  (data parallel: each rank runs a slice of the batch, gradients are summed in optim_step);
- `sharded`: the same with the base sharded over the ranks (FSDP2), whose bytes per rank
  should be about 1/ranks of the single engine's;
- `ratio` of each group's tokens/s to the single engine's. On GPUs (one per rank, NCCL) the
  goal is ≥ 1.8 with 2 ranks; on CPU (gloo) the ranks share the machine's cores with each other
  and the collectives, so the point there is that the group computes the same thing, which the
  tests check, not speed.

Run: `python bench/worker_group.py [--model treadle/tiny-10m] [--ranks 2] [--batch 16]
[--seq 128] [--steps 5] [--device cpu|cuda]`. The losses of the three setups are printed too,
as a check that they trained alike (equal to about 1e-6 relative).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RUN = "bench"
TIMEOUT = timedelta(seconds=300)


def _ops(batch: int, seq: int) -> list[Any]:
    import numpy as np

    from gpu_worker.protocol import Datum, ForwardBackwardOp

    rng = np.random.default_rng(0)
    data = [
        Datum(
            tokens=rng.integers(5, 1000, seq),
            loss_fn_inputs={
                "target_tokens": rng.integers(5, 1000, seq),
                "weights": np.ones(seq, np.float32),
            },
        )
        for _ in range(batch)
    ]
    return [ForwardBackwardOp(RUN, data, "cross_entropy")]


def _train(engine: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Warm up one step, then time `args.steps` steps; tokens/s and the losses."""
    from gpu_worker.protocol import AdamParams, ForwardBackwardResult, LoraSpec

    engine.create_run(RUN, args.model, LoraSpec(rank=32, alpha=32.0, seed=0))
    ops = _ops(args.batch, args.seq)
    adam = AdamParams(learning_rate=1e-3)
    losses = []
    for step in range(args.steps + 1):
        if step == 1:
            start = time.perf_counter()
        (result,) = engine.forward_backward_batch(ops)
        assert isinstance(result, ForwardBackwardResult), result
        losses.append(float(result.metrics["loss:sum"]))
        engine.optim_step(RUN, adam)
    elapsed = time.perf_counter() - start
    return {
        "tokens_per_s": round(args.batch * args.seq * args.steps / elapsed, 1),
        "losses": losses,
    }


def _settings(args: argparse.Namespace, *, rank: int | None, shard: bool) -> Any:
    from gpu_worker.engine import EngineSettings

    if args.device == "cuda":
        device = "cuda:0" if rank is None else f"cuda:{rank}"
        return EngineSettings(device=device, models=(args.model,), shard_base=shard)
    threads = args.ranks if rank is None else 1
    return EngineSettings(
        device="cpu", precision="fp32", num_threads=threads, models=(args.model,), shard_base=shard
    )


def _rank_main(rank: int, args: argparse.Namespace, out: Path, shard: bool) -> None:
    import torch.distributed as dist

    from gpu_worker.engine import Engine
    from gpu_worker.group import GroupComm, GroupEngine, follow

    dist.init_process_group(
        "nccl" if args.device == "cuda" else "gloo",
        init_method=f"file://{out / 'rendezvous'}",
        rank=rank,
        world_size=args.ranks,
        timeout=TIMEOUT,
    )
    try:
        engine = Engine(_settings(args, rank=rank, shard=shard))
        comm = GroupComm(idle_timeout=TIMEOUT)
        (out / f"bytes{rank}").write_text(str(engine.base_memory_bytes()))
        if rank == 0:
            group = GroupEngine(engine, comm)
            try:
                (out / "result.json").write_text(json.dumps(_train(group, args)))
            finally:
                group.close()
        else:
            follow(engine, comm)
    finally:
        dist.destroy_process_group()


def _group(args: argparse.Namespace, *, shard: bool) -> dict[str, Any]:
    import torch.multiprocessing as mp

    out = Path(tempfile.mkdtemp(prefix="treadle-group-bench-"))
    mp.start_processes(_rank_main, args=(args, out, shard), nprocs=args.ranks, start_method="spawn")
    result = json.loads((out / "result.json").read_text())
    result["base_bytes_per_rank"] = [
        int((out / f"bytes{rank}").read_text()) for rank in range(args.ranks)
    ]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="treadle/tiny-10m")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from gpu_worker.engine import Engine

    engine = Engine(_settings(args, rank=None, shard=False))
    single = {**_train(engine, args), "base_bytes": engine.base_memory_bytes()}
    del engine
    replicated = _group(args, shard=False)
    sharded = _group(args, shard=True)
    print(
        json.dumps(
            {
                "benchmark": "worker_group",
                "model": args.model,
                "device": args.device,
                "ranks": args.ranks,
                "batch": f"{args.batch}x{args.seq}",
                "single": single,
                "replicated": replicated,
                "sharded": sharded,
                "ratio": {
                    "replicated": round(replicated["tokens_per_s"] / single["tokens_per_s"], 3),
                    "sharded": round(sharded["tokens_per_s"] / single["tokens_per_s"], 3),
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
