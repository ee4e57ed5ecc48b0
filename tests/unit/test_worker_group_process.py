"""The worker group's process side: which device each rank gets and which models a worker may
serve (aliases as the models they name), with errors that say what to change, rank 0's engine
calls ending the process once the group has failed, the parent's SIGTERM reaching its ranks
however early it comes, and every rank leaving its process group."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from typer.testing import CliRunner

from api.cli import app
from core.errors import ConfigurationError
from core.settings import Settings
from gpu_worker.catalog import Catalog
from gpu_worker.group import GroupFailed
from gpu_worker.ranks import leave_group
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


def test_an_alias_needs_the_devices_of_the_model_it_names() -> None:
    alias = "org/big-alias"
    settings = Settings(
        model_folders={BIG: "/models/big"},
        model_devices={BIG: 2},
        model_aliases={alias: BIG},
    )
    with pytest.raises(ConfigurationError, match=f"{alias} needs a worker group of 2 devices"):
        check_models(settings, [alias], 1)
    check_models(settings, [alias], 2)
    assert shards_base(settings, [alias, "treadle/tiny-1m"])
    # What the worker registers the alias with: its engine's catalog, built as build_engine
    # builds it, resolves the alias to the folder's entry.
    catalog = Catalog(
        entries=[
            Catalog.hf_folder(name, path, devices=settings.model_devices.get(name, 1))
            for name, path in settings.model_folders.items()
        ],
        aliases=dict(settings.model_aliases),
    )
    for name in (alias, BIG, "treadle/tiny-1m"):
        assert process.devices_needed(settings, name) == catalog.resolve(name).devices


def _folder(path: Path, tied: bool | None) -> str:
    path.mkdir()
    config = {"model_type": "llama"} | ({} if tied is None else {"tie_word_embeddings": tied})
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_a_sharding_group_refuses_a_folder_with_tied_embeddings(tmp_path: Path) -> None:
    tied, untied = _folder(tmp_path / "tied", True), _folder(tmp_path / "untied", False)
    unsaid = _folder(tmp_path / "unsaid", None)
    small = "small/tied"
    folders = {BIG: tied, small: tied, "big/untied": untied, "big/unsaid": unsaid}
    devices = {BIG: 2, "big/untied": 2, "big/unsaid": 2}
    settings = Settings(
        model_folders=folders, model_devices=devices, model_aliases={"tied/alias": BIG}
    )
    for served in ([BIG], ["tied/alias", "treadle/tiny-1m"]):
        with pytest.raises(
            ConfigurationError,
            match=r"needs 2 devices \(TREADLE_MODEL_DEVICES\), so its group shards its base "
            r"weights, but .*'s unembedding is tied to its embeddings \(tie_word_embeddings in "
            f"{tied}/config.json" + r"\), which a sharded base does not support; serve .* with "
            r"one device",
        ):
            check_models(settings, served, 2)
    with pytest.raises(
        ConfigurationError,
        match=r"this group shards its base weights, every model's, since big/untied needs "
        r"several devices .* but small/tied's unembedding is tied .* serve small/tied on "
        r"workers that do not serve big/untied",
    ):
        check_models(settings, ["big/untied", small], 2)
    # Replicated, a tied model is served as usual; untied or unsaid, it is sharded.
    check_models(settings, [small, "treadle/tiny-1m"], 2)
    check_models(settings, ["big/untied", "big/unsaid", "treadle/tiny-1m"], 2)


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


@pytest.fixture
def parent_signals() -> Iterator[None]:
    """run_worker_group installs its own SIGTERM and SIGINT handlers: put pytest's back."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def _sleeper() -> None:
    time.sleep(60)


def _stops_on_sigterm(ready: Any, done: Any) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    ready.release()
    signal.sigwait({signal.SIGTERM})
    done.release()


def _follows(done: Any) -> None:
    done.acquire(timeout=60)


def test_a_sigterm_while_the_ranks_start_ends_them_and_the_group_with_status_0(
    monkeypatch: pytest.MonkeyPatch, parent_signals: None
) -> None:
    started: list[BaseProcess] = []

    def spawn(fn: Any, args: tuple[Any, ...], nprocs: int) -> list[BaseProcess]:
        # The stop arrives before the ranks are known to the parent.
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(nprocs):
            rank = multiprocessing.get_context("fork").Process(target=_sleeper)
            rank.start()
            started.append(rank)
        return list(started)

    monkeypatch.setattr("gpu_worker.ranks.spawn", spawn)
    status = process.run_worker_group(
        Settings(), worker_id="w", models=["treadle/tiny-1m"], devices=["cpu", "cpu"]
    )
    assert status == 0
    assert [rank.exitcode for rank in started] == [-signal.SIGKILL, -signal.SIGKILL]


def test_a_sigterm_once_the_ranks_run_goes_to_rank_0_alone(
    monkeypatch: pytest.MonkeyPatch, parent_signals: None
) -> None:
    fork = multiprocessing.get_context("fork")
    ready, done = fork.Semaphore(0), fork.Semaphore(0)
    started: list[BaseProcess] = []

    def spawn(fn: Any, args: tuple[Any, ...], nprocs: int) -> list[BaseProcess]:
        started.append(fork.Process(target=_stops_on_sigterm, args=(ready, done)))
        started.append(fork.Process(target=_follows, args=(done,)))
        for rank in started:
            rank.start()
        return list(started)

    main, watching = threading.get_ident(), threading.Event()
    wait = multiprocessing.connection.wait

    def watch(*args: Any, **kwargs: Any) -> Any:
        watching.set()  # the parent knows its ranks and watches them
        return wait(*args, **kwargs)

    def stop() -> None:
        assert ready.acquire(timeout=30) and watching.wait(30)
        signal.pthread_kill(main, signal.SIGTERM)

    monkeypatch.setattr("gpu_worker.ranks.spawn", spawn)
    monkeypatch.setattr(process.multiprocessing.connection, "wait", watch)
    stopper = threading.Thread(target=stop)
    stopper.start()
    status = process.run_worker_group(
        Settings(), worker_id="w", models=["treadle/tiny-1m"], devices=["cpu", "cpu"]
    )
    stopper.join()
    assert status == 0
    assert [rank.exitcode for rank in started] == [0, 0]


def test_a_rank_leaves_its_process_group_however_its_serving_ends(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    served: list[bool] = []

    def serve(*args: Any) -> None:
        served.append(dist.is_initialized())
        raise RuntimeError("the engine could not load")

    monkeypatch.setattr(process, "_serve_rank", serve)
    init = f"file://{tmp_path / 'rendezvous'}"
    with pytest.raises(RuntimeError, match="could not load"):
        process._rank_life(0, Settings(), "w", ["treadle/tiny-1m"], ["cpu"], init)
    assert served == [True]
    assert not dist.is_initialized()
    leave_group()  # without a group: nothing to do


def _stopped_while_starting(give_up_after: float, conn: Any) -> None:
    """A worker process stopped before Celery handles signals: what becomes of the SIGTERM."""
    process.EARLY_STOP_SECONDS = give_up_after
    early = process._EarlyStop()
    early.install()
    os.kill(os.getpid(), signal.SIGTERM)  # held: the process goes on
    conn.send("held")
    if give_up_after > 1:
        # Celery starts and installs its own handler, then says it is ready.
        signal.signal(signal.SIGTERM, lambda *_: conn.send("celery stops"))
        early.replay()
        conn.send("replayed")
    time.sleep(5)
    conn.send("never ended")


def test_a_sigterm_before_celery_is_ready_is_held_and_sent_again_once_it_is() -> None:
    fork = multiprocessing.get_context("fork")
    ours, theirs = fork.Pipe()
    child = fork.Process(target=_stopped_while_starting, args=(60.0, theirs))
    child.start()
    try:
        assert ours.recv() == "held"
        assert ours.recv() == "celery stops"  # Celery's handler got the replayed SIGTERM
        assert ours.recv() == "replayed"
    finally:
        child.kill()
        child.join(10)


def test_a_sigterm_held_for_a_celery_that_never_gets_ready_ends_the_process() -> None:
    fork = multiprocessing.get_context("fork")
    ours, theirs = fork.Pipe()
    child = fork.Process(target=_stopped_while_starting, args=(0.3, theirs))
    child.start()
    assert ours.recv() == "held"
    child.join(10)
    assert child.exitcode == 128 + signal.SIGTERM
    assert not ours.poll()  # it never reached the end of its sleep
