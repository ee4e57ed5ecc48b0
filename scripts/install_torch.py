"""Install the pinned PyTorch into the running environment, choosing the build for this machine.

scripts/bootstrap.sh runs this before anything that depends on torch, so that nothing else pulls
an unpinned build (on Linux, PyPI's torch is a multi-GB CUDA build). Nothing is installed when
torch is already importable.

- `TREADLE_TORCH_VERSION` (default 2.13.0): the version installed.
- `TREADLE_TORCH_INDEX_URL`: an extra package index to take torch from (e.g.
  https://download.pytorch.org/whl/cu124). Unset: PyTorch's CPU index on a machine without an
  NVIDIA GPU, nothing extra on one with a GPU. Empty: nothing extra, whatever pip is configured
  with.

The index is passed to pip as an *extra* index, so pip's own indexes and find-links still apply:
pip takes the highest matching version, and a build such as `2.13.0+cpu` ranks above PyPI's
plain `2.13.0`. Before installing, the index is probed with a short timeout; PyTorch's CPU index
being unreachable (an offline mirror, a firewall) falls back to pip's configuration instead of
letting pip retry for minutes. An index chosen explicitly must be reachable.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable

DEFAULT_VERSION = "2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_SECONDS = 5.0


@dataclasses.dataclass(frozen=True)
class Choice:
    """The pip arguments that select torch's build, and one line saying which and why."""

    pip_args: tuple[str, ...]
    reason: str


class UnreachableIndex(Exception):
    """The index named by TREADLE_TORCH_INDEX_URL did not answer."""


def choose(
    version: str,
    *,
    gpu: bool,
    index_url: str | None,
    reachable: Callable[[str], bool],
) -> Choice:
    """The build to install. `index_url` is TREADLE_TORCH_INDEX_URL (None when unset); `gpu`
    says whether an NVIDIA GPU is present; `reachable` probes an index (called at most once)."""
    if index_url == "":
        return Choice(
            (), f"torch {version}: pip's configured indexes (TREADLE_TORCH_INDEX_URL is empty)"
        )
    if index_url is not None:
        if not reachable(index_url):
            raise UnreachableIndex(
                f"TREADLE_TORCH_INDEX_URL={index_url} does not answer; fix the address, or set it "
                "empty to install torch from pip's configured indexes"
            )
        return Choice(
            ("--extra-index-url", index_url),
            f"torch {version}: from {index_url} (TREADLE_TORCH_INDEX_URL)",
        )
    if gpu:
        return Choice(
            (),
            f"torch {version}: default build from pip's indexes (CUDA on Linux): NVIDIA GPU found",
        )
    if not reachable(CPU_INDEX):
        return Choice(
            (),
            f"torch {version}: no NVIDIA GPU, but {CPU_INDEX} does not answer, so whatever pip's "
            "configured indexes offer (TREADLE_TORCH_INDEX_URL= skips this check)",
        )
    return Choice(
        ("--extra-index-url", CPU_INDEX),
        f"torch {version}: CPU build from {CPU_INDEX}: no NVIDIA GPU found "
        "(TREADLE_TORCH_INDEX_URL chooses another index)",
    )


def nvidia_gpu_present() -> bool:
    """True when `nvidia-smi -L` lists a GPU."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        listed = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def index_answers(index_url: str) -> bool:
    """True when the index serves a torch project page within PROBE_SECONDS."""
    url = index_url.rstrip("/") + "/torch/"
    try:
        with urllib.request.urlopen(url, timeout=PROBE_SECONDS) as response:
            return bool(response.status < 400)
    except (OSError, ValueError):  # URLError and HTTPError are OSErrors; ValueError: bad URL
        return False


def main() -> int:
    if importlib.util.find_spec("torch") is not None:
        return 0
    version = os.environ.get("TREADLE_TORCH_VERSION") or DEFAULT_VERSION
    try:
        choice = choose(
            version,
            gpu=nvidia_gpu_present(),
            index_url=os.environ.get("TREADLE_TORCH_INDEX_URL"),
            reachable=index_answers,
        )
    except UnreachableIndex as error:
        print(error, file=sys.stderr)
        return 1
    print(choice.reason, flush=True)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", *choice.pip_args]
    return subprocess.run([*pip, f"torch=={version}"], check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
