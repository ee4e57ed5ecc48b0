"""A worker group's ranks as processes: one spawned process per device, each joining the
default torch.distributed process group (NCCL between GPUs, gloo on the CPU).

What each rank runs is its caller's (`scheduler.worker.process`); this module only starts
them and connects them, and knows nothing of the control plane.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def cuda_device_count() -> int:
    """The CUDA devices this machine has (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def spawn(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> list[BaseProcess]:
    """Start `fn(rank, *args)` in `nprocs` fresh (spawned) processes, without waiting for
    them: the caller watches them and decides what one ending means."""
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    assert context is not None
    return list(context.processes)


def join_group(rank: int, devices: list[str], init_method: str, timeout: timedelta) -> None:
    """Make this process rank `rank` of the group on `devices` (one per rank): pin its
    device and join the default process group, waiting for every rank; `timeout` bounds
    each collective of that group."""
    device = devices[rank]
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=len(devices),
        timeout=timeout,
    )


def leave_group() -> None:
    """Destroy this process's default process group, if it joined one: a rank exiting with
    its NCCL communicators still up can hang at interpreter teardown."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
