"""The worker group's process side: which device each rank gets and which models a worker may
serve, with errors that say what to change, and rank 0's engine calls ending the process once
the group has failed."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from typer.testing import CliRunner

from api.cli import app
from core.errors import ConfigurationError
from core.settings import Settings
from gpu_worker.group import GroupFailed
from scheduler.worker import process
from scheduler.worker.process import _Watched, check_models, group_devices, shards_base

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


BIG = "big/model"


def test_a_worker_refuses_a_model_needing_more_devices_than_it_has() -> None:
    settings = Settings(model_folders={BIG: "/models/big"}, model_devices={BIG: 2})
    check_models(settings, [BIG, "treadle/tiny-1m"], 2)
    check_models(settings, [BIG], 4)
    with pytest.raises(
        ConfigurationError,
        match=r"big/model needs a worker group of 2 devices \(TREADLE_MODEL_DEVICES\) and this "
        r"worker has 1; start it with --group-size 2 or more, or leave big/model out",
    ):
        check_models(settings, ["treadle/tiny-1m", BIG], 1)
    stray = Settings(model_devices={"treadle/tiny-1m": 2})
    with pytest.raises(ConfigurationError, match="TREADLE_MODEL_DEVICES names treadle/tiny-1m"):
        check_models(stray, ["treadle/tiny-1m"], 2)


def test_a_group_shards_its_base_when_a_model_needs_more_than_one_device() -> None:
    settings = Settings(model_folders={BIG: "/models/big"}, model_devices={BIG: 2})
    assert shards_base(settings, [BIG, "treadle/tiny-1m"])
    assert not shards_base(settings, ["treadle/tiny-1m"])
    assert not shards_base(Settings(), ["treadle/tiny-1m", "treadle/tiny-10m"])


def test_the_worker_command_refuses_it_before_starting_anything() -> None:
    env = {
        "TREADLE_DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:1/none",
        "TREADLE_REDIS_URL": "redis://127.0.0.1:1/0",
        "TREADLE_SERVER_SECRET": "a-secret-of-32-characters-000000",
        "TREADLE_MODEL_FOLDERS": '{"big/model": "/models/big"}',
        "TREADLE_MODEL_DEVICES": '{"big/model": 2}',
        "COLUMNS": "300",
    }
    result = CliRunner().invoke(app, ["worker", "--device", "cpu", "--models", BIG], env=env)
    assert result.exit_code != 0
    assert "start it with --group-size 2 or more" in " ".join(result.output.split())


def test_model_devices_are_at_least_one() -> None:
    with pytest.raises(ValueError, match="give each model at least 1"):
        Settings(model_devices={BIG: 0})


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
