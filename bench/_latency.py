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


class TinyOps:
    """optim_steps on a rank-1 adapter of the 1M model through the tinker SDK, each submitted
    and awaited alone, after `warm_up` unmeasured; measured in batches (`run`): their round
    trips in ms, and the CPU time process `server_pid` spent meanwhile."""

    def __init__(
        self, base_url: str, key: str, server_pid: int | None = None, warm_up: int = 5
    ) -> None:
        import tinker
        from tinker import types

        self._pid = server_pid
        self._client = tinker.ServiceClient(base_url=base_url, api_key=key)
        self._trainer = self._client.create_lora_training_client(
            base_model="treadle/tiny-1m", rank=1
        ).result()
        self._adam = types.AdamParams()
        self.rtts: list[float] = []
        self._cpu_seconds: float | None = 0.0
        for _ in range(warm_up):
            self._trainer.optim_step(self._adam).result()

    def _cpu(self) -> float | None:
        return None if self._pid is None else process_cpu_seconds(self._pid)

    def run(self, n: int) -> None:
        """`n` more measured round trips."""
        cpu_before = self._cpu()
        for _ in range(n):
            t0 = time.perf_counter()
            self._trainer.optim_step(self._adam).result()
            self.rtts.append((time.perf_counter() - t0) * 1000)
        cpu_after = self._cpu()
        if self._cpu_seconds is not None and cpu_before is not None and cpu_after is not None:
            self._cpu_seconds += cpu_after - cpu_before
        else:
            self._cpu_seconds = None

    def cpu_ms_per_op(self) -> float | None:
        """The server's CPU time per measured op (None where unknown)."""
        if self._cpu_seconds is None or not self.rtts:
            return None
        return round(self._cpu_seconds * 1000 / len(self.rtts), 2)

    def close(self) -> None:
        self._client.close("success").result(timeout=60)


def _optim_step_round_trips(
    base_url: str, key: str, n: int, server_pid: int | None = None
) -> tuple[list[float], float | None]:
    """`n` round trips of `TinyOps`, and the CPU time per op of process `server_pid` over
    them (None where unknown)."""
    ops = TinyOps(base_url, key, server_pid)
    ops.run(n)
    ops.close()
    return ops.rtts, ops.cpu_ms_per_op()


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
