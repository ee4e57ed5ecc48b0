"""The tiny-op round trip through the tinker SDK, beside the floor measured in the same run.

The floor is a bare HTTP round trip to the same server (`GET /api/v1/healthz` on a kept-alive
connection): what any request costs before Treadle does anything. The SDK floor is the same op
through the tinker SDK against a server that answers from memory (`bench._sdk_floor`): what the
client itself costs, which no server can go below. The server's CPU time per op
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


def _optim_step_round_trips(
    base_url: str, key: str, n: int, server_pid: int | None = None
) -> tuple[list[float], float | None]:
    """`n` optim_steps on a rank-1 adapter of the 1M model through the tinker SDK, each
    submitted and awaited alone, after 5 unmeasured: their round trips in ms, and the CPU time
    per op of process `server_pid` over the measured ones (None where unknown)."""
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=base_url, api_key=key)
    trainer = client.create_lora_training_client(base_model="treadle/tiny-1m", rank=1).result()
    for _ in range(5):
        trainer.optim_step(types.AdamParams()).result()
    rtts = []
    cpu_before = None if server_pid is None else process_cpu_seconds(server_pid)
    for _ in range(n):
        t0 = time.perf_counter()
        trainer.optim_step(types.AdamParams()).result()
        rtts.append((time.perf_counter() - t0) * 1000)
    cpu_after = None if server_pid is None else process_cpu_seconds(server_pid)
    client.close("success").result(timeout=60)
    if cpu_before is None or cpu_after is None:
        return rtts, None
    return rtts, round((cpu_after - cpu_before) * 1000 / n, 2)


def sdk_floor(n: int = 200) -> dict[str, float]:
    """The SDK's own tiny-op round trip, against a server that answers from memory
    (`bench._sdk_floor`)."""
    from bench._sdk_floor import floor_server
    from tests.services import free_port

    with floor_server(free_port()) as url:
        rtts, _ = _optim_step_round_trips(url, "tml-floor", n)
    return quantiles_ms(rtts)


def tiny_op_latency(base_url: str, key: str, api_pid: int, n: int = 200) -> dict[str, Any]:
    """optim_step on a rank-1 adapter of the 1M model, submitted and awaited one at a time,
    beside two floors measured in the same run: a bare HTTP round trip to the same server, and
    the same op through the SDK against a server that does nothing (`sdk_floor`)."""
    import httpx

    with httpx.Client() as bare:
        bare.get(f"{base_url}/api/v1/healthz")
        floor = []
        for _ in range(n):
            t0 = time.perf_counter()
            bare.get(f"{base_url}/api/v1/healthz").raise_for_status()
            floor.append((time.perf_counter() - t0) * 1000)

    rtts, cpu_ms = _optim_step_round_trips(base_url, key, n, api_pid)
    rtt, bare_rtt, sdk_rtt = quantiles_ms(rtts), quantiles_ms(floor), sdk_floor(n)
    return {
        "tiny_op_rtt_ms": rtt,
        "floor_rtt_ms": bare_rtt,
        "tiny_op_vs_floor_p50": round(rtt["p50"] / bare_rtt["p50"], 1),
        "sdk_floor_rtt_ms": sdk_rtt,
        "tiny_op_over_sdk_floor_p50_ms": round(rtt["p50"] - sdk_rtt["p50"], 2),
        "api_cpu_ms_per_op": cpu_ms,
    }
