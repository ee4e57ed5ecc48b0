"""The worker group's process side: which device each rank gets, with errors that say what to
change, and rank 0's engine calls ending the process once the group has failed."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from core.errors import ConfigurationError
from gpu_worker.group import GroupFailed
from scheduler.worker import process
from scheduler.worker.process import _Watched, group_devices

pytestmark = pytest.mark.unit


def test_cpu_repeats_for_every_rank_and_named_devices_are_kept() -> None:
    assert group_devices("cpu", 3) == ["cpu", "cpu", "cpu"]
    assert group_devices("cuda:3", 1) == ["cuda:3"]
    assert group_devices("auto", 2, ["cuda:4", "cuda:5"]) == ["cuda:4", "cuda:5"]


@pytest.mark.parametrize(("gpus", "expected"), [(0, ["cpu", "cpu"]), (4, ["cuda:0", "cuda:1"])])
def test_auto_takes_the_first_gpus_else_the_cpu(
    monkeypatch: pytest.MonkeyPatch, gpus: int, expected: list[str]
) -> None:
    monkeypatch.setattr("gpu_worker.ranks.cuda_device_count", lambda: gpus)
    assert group_devices("auto", 2) == expected


@pytest.mark.parametrize(
    ("device", "size", "devices", "gpus", "says"),
    [
        ("auto", 2, ["cuda:0"], 2, "--devices names 1 device(s) for a group of 2"),
        ("cuda:1", 2, None, 2, "name one device per rank with --devices"),
        ("cuda", 4, None, 2, "needs 4 GPUs and this machine has 2; lower --group-size"),
        ("cuda", 2, None, 0, "--device cuda but this machine has no CUDA device"),
    ],
)
def test_a_group_that_cannot_work_is_refused_saying_what_to_change(
    monkeypatch: pytest.MonkeyPatch,
    device: str,
    size: int,
    devices: list[str] | None,
    gpus: int,
    says: str,
) -> None:
    monkeypatch.setattr("gpu_worker.ranks.cuda_device_count", lambda: gpus)
    with pytest.raises(ConfigurationError, match=says.replace("(", r"\(").replace(")", r"\)")):
        group_devices(device, size, devices)


class _Exited(Exception):
    pass


class _FakeGroup:
    device = "cpu"

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def slow(self) -> str:
        self.entered.set()
        self.release.wait(5)
        return "done"

    def broken(self) -> None:
        raise GroupFailed("ranks disagree on OptimStep")


def test_watched_calls_are_timed_and_a_failed_group_ends_the_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def exit_(status: int) -> Any:
        raise _Exited(status)

    monkeypatch.setattr(process.os, "_exit", exit_)
    group = _FakeGroup()
    watched = _Watched(group)  # type: ignore[arg-type]
    assert watched.device == "cpu"
    assert watched.busy_seconds() == 0.0
    results: list[str] = []
    caller = threading.Thread(target=lambda: results.append(watched.slow()))
    caller.start()
    assert group.entered.wait(5)
    assert watched.busy_seconds() > 0.0
    group.release.set()
    caller.join(5)
    assert results == ["done"] and watched.busy_seconds() == 0.0
    with pytest.raises(_Exited) as exited:
        watched.broken()
    assert exited.value.args == (3,)
    assert watched.busy_seconds() == 0.0
