"""The tiny-op round trip through the tinker SDK, beside the floor measured in the same run.

The floor is a bare HTTP round trip to the same server (`GET /api/v1/healthz` on a kept-alive
connection): what any request costs before Treadle does anything. The server's CPU time per op
is read from /proc (Linux), so it counts every thread of the process that serves the API.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far; None where /proc is not available."""
    stat = Path(f"/proc/{pid}/stat")
    if not stat.exists():
        return None
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def quantiles_ms(samples: list[float]) -> dict[str, float]:
    return {
        "p50": round(statistics.median(samples), 2),
        "p90": round(statistics.quantiles(samples, n=10)[-1], 2),
    }


def tiny_op_latency(base_url: str, key: str, api_pid: int, n: int = 200) -> dict[str, Any]:
    """optim_step on a rank-1 adapter of the 1M model, submitted and awaited one at a time."""
    import httpx
    import tinker
    from tinker import types

    with httpx.Client() as bare:
        bare.get(f"{base_url}/api/v1/healthz")
        floor = []
        for _ in range(n):
            t0 = time.perf_counter()
            bare.get(f"{base_url}/api/v1/healthz").raise_for_status()
            floor.append((time.perf_counter() - t0) * 1000)

    client = tinker.ServiceClient(base_url=base_url, api_key=key)
    trainer = client.create_lora_training_client(base_model="treadle/tiny-1m", rank=1).result()
    for _ in range(5):
        trainer.optim_step(types.AdamParams()).result()
    rtts = []
    cpu_before = process_cpu_seconds(api_pid)
    for _ in range(n):
        t0 = time.perf_counter()
        trainer.optim_step(types.AdamParams()).result()
        rtts.append((time.perf_counter() - t0) * 1000)
    cpu_after = process_cpu_seconds(api_pid)
    client.close("success").result(timeout=60)
    cpu_ms = None
    if cpu_before is not None and cpu_after is not None:
        cpu_ms = round((cpu_after - cpu_before) * 1000 / n, 2)
    rtt, bare_rtt = quantiles_ms(rtts), quantiles_ms(floor)
    return {
        "tiny_op_rtt_ms": rtt,
        "floor_rtt_ms": bare_rtt,
        "tiny_op_vs_floor_p50": round(rtt["p50"] / bare_rtt["p50"], 1),
        "api_cpu_ms_per_op": cpu_ms,
    }
