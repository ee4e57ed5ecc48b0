"""Start an embedded Treadle server as a separate process, the way a user runs it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

KEY_RE = re.compile(r"tml-[0-9a-f]{12}-[A-Za-z0-9_-]{32,}")


class Server(NamedTuple):
    url: str
    key: str
    pid: int


@contextlib.contextmanager
def embedded_server(
    port: int, *, threads: int, models: list[str], source: Path | None = None
) -> Iterator[Server]:
    """A fresh `treadle-server serve` on 127.0.0.1:port: its URL, API key and process id.
    `source` runs the server packages of another checkout of this repository (its root, put
    first on the server's import path) with this environment's dependencies."""
    data = tempfile.mkdtemp(prefix="treadle-bench-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TREADLE_")}
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source), env.get("PYTHONPATH")]))
    env.update(
        TREADLE_DATA_DIR=data,
        TREADLE_TORCH_THREADS=str(threads),
        OMP_NUM_THREADS=str(threads),
        TREADLE_MODELS=json.dumps(models),
        COLUMNS="200",
    )
    cli = str(Path(sys.executable).with_name("treadle-server"))
    proc = subprocess.Popen(
        [cli, "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    output = ""
    deadline = time.monotonic() + 120
    while "Uvicorn running on" not in output:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server did not start:\n{output}")
        output += proc.stdout.readline()
    match = KEY_RE.search(output)
    assert match, output
    # Keep reading the server's output: a full pipe would block its logging, and the server.
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    try:
        yield Server(f"http://127.0.0.1:{port}", match.group(0), proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
