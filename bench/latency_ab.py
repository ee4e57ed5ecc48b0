"""The tiny-op round trip of this checkout against another revision's, side by side.

A change to the hot path moves the round trip by a millisecond or two, while the same server
measured twice on a busy machine differs by more. So both servers run at once, and the ops
alternate between them in short batches (which server goes first alternates too): whatever
else loads the machine loads both alike. Each server is an embedded `treadle-server serve`
process, its own database; the base revision is checked out into a temporary git worktree and
run with this environment's dependencies, so it must be able to run with them.

Prints one JSON object: each server's p50/p90/mean round trip of an optim_step on a rank-1
adapter of the 1M model through the tinker SDK (as `bench/e2e_sft.py` measures it), its CPU
time per op, and `p50_ratio`, this checkout's p50 over the base's.

Run: `python bench/latency_ab.py --base main [--rounds 20] [--batch 25]`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._latency import TinyOps, quantiles_ms  # noqa: E402
from bench._server import embedded_server  # noqa: E402


@contextlib.contextmanager
def worktree(revision: str) -> Iterator[Path]:
    """`revision` of this repository checked out in a temporary folder."""
    parent = Path(tempfile.mkdtemp(prefix="treadle-ab-"))
    folder = parent / "tree"
    git = ["git", "-C", str(ROOT)]
    subprocess.run(
        [*git, "worktree", "add", "--quiet", "--detach", str(folder), revision], check=True
    )
    try:
        yield folder
    finally:
        subprocess.run([*git, "worktree", "remove", "--force", str(folder)], check=True)
        shutil.rmtree(parent, ignore_errors=True)


def report(ops: TinyOps) -> dict[str, Any]:
    ops.close()
    return {
        "rtt_ms": quantiles_ms(ops.rtts),
        "mean_ms": round(statistics.mean(ops.rtts), 2),
        "cpu_ms_per_op": ops.cpu_ms_per_op(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the revision to compare against")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch", type=int, default=25, help="ops per server per round")
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")

    from tests.services import free_port

    models = ["treadle/tiny-1m"]
    with (
        worktree(args.base) as base_tree,
        embedded_server(free_port(), threads=1, models=models, source=base_tree) as base,
        embedded_server(free_port(), threads=1, models=models, source=ROOT) as this,
    ):
        sides = {"base": TinyOps(*base, warm_up=10), "this": TinyOps(*this, warm_up=10)}
        for round_ in range(args.rounds):
            for name in ("base", "this") if round_ % 2 == 0 else ("this", "base"):
                sides[name].run(args.batch)
        reports = {name: report(ops) for name, ops in sides.items()}
    print(
        json.dumps(
            {
                "benchmark": "latency_ab",
                "base_revision": args.base,
                "ops_per_server": args.rounds * args.batch,
                **reports,
                "p50_ratio": round(
                    reports["this"]["rtt_ms"]["p50"] / reports["base"]["rtt_ms"]["p50"], 3
                ),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
