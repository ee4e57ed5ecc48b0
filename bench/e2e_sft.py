"""SFT throughput through the tinker SDK and an embedded server, vs the same work in-process.

Prints one JSON object:
- `sdk_tokens_per_s`: a forward_backward + optim_step loop driven by the official tinker SDK
  against `treadle-server serve` running as its own process (submitted back to back);
- `inprocess_tokens_per_s`: the identical computation on an Engine in this process;
- `ratio` = sdk / in-process (goal ≥ 0.95);
- `treadle_sdk_tokens_per_s`: the same loop with Treadle's own client, and its ratio to the
  tinker SDK's (goal ≥ 1);
- `tiny_op_rtt_ms`: p50/p90 round trip of a tiny op (optim_step on a 1M model) through the
  SDK — submit, long-poll, result (goal p50 ≤ 5 ms) — beside `floor_rtt_ms`, a bare HTTP round
  trip to the same server in the same run, `sdk_floor_rtt_ms`, the same op through the SDK
  against a server that does nothing (the client's own cost), and `api_cpu_ms_per_op`, the
  server process's CPU time per tiny op (embedded mode: the API and the engine thread together).

Run: `python bench/e2e_sft.py [--model treadle/tiny-10m] [--batch 8] [--seq 256] [--steps 8]`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._latency import tiny_op_latency
from bench._server import embedded_server


def _batch(batch: int, seq: int, vocab: int = 4000) -> list[list[int]]:
    return [[(131 * b + 7 * t) % (vocab - 10) + 5 for t in range(seq + 1)] for b in range(batch)]


def inprocess(model: str, rows: list[list[int]], steps: int, threads: int) -> float:
    import numpy as np

    from gpu_worker.engine import Engine, EngineSettings
    from gpu_worker.protocol import AdamParams, Datum, LoraSpec

    engine = Engine(EngineSettings(num_threads=threads))
    engine.create_run("bench", model, LoraSpec(rank=32, alpha=32.0, seed=0))
    data = [
        Datum(
            tokens=np.array(r[:-1]),
            loss_fn_inputs={
                "target_tokens": np.array(r[1:]),
                "weights": np.ones(len(r) - 1, np.float32),
            },
        )
        for r in rows
    ]
    tokens = sum(len(r) - 1 for r in rows)
    engine.forward_backward("bench", data)  # warm-up
    engine.optim_step("bench", AdamParams())
    start = time.perf_counter()
    for _ in range(steps):
        engine.forward_backward("bench", data)
        engine.optim_step("bench", AdamParams())
    return tokens * steps / (time.perf_counter() - start)


def through_sdk(base_url: str, key: str, model: str, rows: list[list[int]], steps: int) -> float:
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=base_url, api_key=key)
    trainer = client.create_lora_training_client(base_model=model, rank=32, seed=0).result()
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(r[:-1]),
            loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)},
        )
        for r in rows
    ]
    tokens = sum(len(r) - 1 for r in rows)
    trainer.forward_backward(data, "cross_entropy").result()
    trainer.optim_step(types.AdamParams()).result()
    start = time.perf_counter()
    pending = []
    for _ in range(steps):
        pending.append(trainer.forward_backward(data, "cross_entropy"))
        pending.append(trainer.optim_step(types.AdamParams()))
    for future in pending:
        future.result()
    throughput = tokens * steps / (time.perf_counter() - start)
    client.close("success").result(timeout=60)
    return throughput


def through_treadle(
    base_url: str, key: str, model: str, rows: list[list[int]], steps: int
) -> float:
    """The same loop with Treadle's own client."""
    import treadle
    from treadle import types

    with treadle.ServiceClient(base_url=base_url, api_key=key) as client:
        trainer = client.create_lora_training_client(model, rank=32, seed=0)
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(r[:-1]),
                loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)},
            )
            for r in rows
        ]
        trainer.forward_backward(data, "cross_entropy").result()
        trainer.optim_step(types.AdamParams()).result()
        start = time.perf_counter()
        pending = []
        for _ in range(steps):
            pending.append(trainer.forward_backward(data, "cross_entropy"))
            pending.append(trainer.optim_step(types.AdamParams()))
        for future in pending:
            future.result()
        return sum(len(r) - 1 for r in rows) * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="treadle/tiny-10m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--tiny-ops", type=int, default=200, help="round trips measured")
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    rows = _batch(args.batch, args.seq)

    from tests.services import free_port

    with embedded_server(
        args.port or free_port(), threads=args.threads, models=[args.model, "treadle/tiny-1m"]
    ) as server:
        sdk_tps = through_sdk(server.url, server.key, args.model, rows, args.steps)
        treadle_tps = through_treadle(server.url, server.key, args.model, rows, args.steps)
        latency = tiny_op_latency(server.url, server.key, server.pid, args.tiny_ops)
    local_tps = inprocess(args.model, rows, args.steps, args.threads)
    print(
        json.dumps(
            {
                "benchmark": "e2e_sft",
                "model": args.model,
                "batch": f"{args.batch}x{args.seq}",
                "threads": args.threads,
                "steps": args.steps,
                "sdk_tokens_per_s": round(sdk_tps, 1),
                "inprocess_tokens_per_s": round(local_tps, 1),
                "ratio": round(sdk_tps / local_tps, 3),
                "treadle_sdk_tokens_per_s": round(treadle_tps, 1),
                "treadle_vs_tinker_sdk": round(treadle_tps / sdk_tps, 3),
                **latency,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
