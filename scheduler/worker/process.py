"""A worker process: one engine on one device, consuming its own Celery queue.

Besides Celery wake-ups it polls the database now and then (a lost message costs a poll, not
an operation), renews its lease, and frees runs whose sessions ended.

A worker group (`run_worker_group`) is N such ranks, one process and one device each: rank 0
runs the worker above over a `gpu_worker.group.GroupEngine`, the other ranks follow its
commands, and the parent process watches them all. Any rank that ends ends the group, so it
is declared dead (or leaves) as one worker.
"""

from __future__ import annotations

import itertools
import json
import logging
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from celery.signals import worker_ready, worker_shutting_down

from core import liveness
from core.clock import SystemClock
from core.db import Database
from core.errors import ConfigurationError
from core.objectstore import open_store
from core.settings import Settings
from core.tables import WorkerStatus
from scheduler import artifact_cache, metrics
from scheduler.celery_app import make_celery, worker_queue
from scheduler.notify import RedisNotifier
from scheduler.worker.celery_tasks import install_host, register_tasks

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from celery import Celery

    from gpu_worker.engine import Engine
    from gpu_worker.group import GroupEngine
    from scheduler.worker.host import WorkerHost

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0
# How long a stop that came before Celery's own signal handling is held for it (`_EarlyStop`).
EARLY_STOP_SECONDS = 60.0


class _EarlyStop:
    """SIGTERM before Celery handles signals itself (it installs its handlers as it starts, after
    the worker registered): held, and sent again once Celery is ready, so a worker stopped
    while it starts still leaves through the hand-over rather than dying with its lease live.
    A Celery that is not ready within `EARLY_STOP_SECONDS` (its broker unreachable) is not
    waited for: the process then ends as SIGTERM would have ended it. One per process.

    The handler and `replay` both run on the main thread, and the timer only reads a flag: no
    lock, which a signal handler could deadlock on."""

    def __init__(self) -> None:
        self._pending: threading.Timer | None = None
        self._ready = False

    def install(self) -> None:
        """From the main thread, before the worker registers; again is harmless."""
        signal.signal(signal.SIGTERM, self._held)

    def _held(self, _signum: int, _frame: object) -> None:
        if self._pending is not None:
            return
        log.info("stopping once the worker is ready (at most %.0f s)", EARLY_STOP_SECONDS)
        self._pending = threading.Timer(EARLY_STOP_SECONDS, self._give_up)
        self._pending.daemon = True
        self._pending.start()

    def _give_up(self) -> None:
        if self._ready:
            return
        log.warning("the worker was not ready %.0f s after SIGTERM; exiting", EARLY_STOP_SECONDS)
        os._exit(128 + signal.SIGTERM)

    def replay(self, **_: object) -> None:
        """Celery's `worker_ready`: a stop held meanwhile reaches Celery's own handler now."""
        self._ready = True
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.cancel()
            os.kill(os.getpid(), signal.SIGTERM)


_early_stop = _EarlyStop()
worker_ready.connect(_early_stop.replay, weak=False)


def default_worker_id(device: str) -> str:
    return f"{socket.gethostname()}-{device.replace(':', '')}-{uuid.uuid4().hex[:6]}"


def run_worker(
    settings: Settings,
    *,
    worker_id: str,
    models: list[str],
    engine: Engine | None = None,
    group_size: int = 1,
    stuck: Callable[[], str | None] | None = None,
) -> None:
    """Serve `models` as worker `worker_id` until stopped. `engine` is one already built (a
    worker group's rank 0 passes its group's, of `group_size` ranks); `stuck`, asked before
    each lease renewal, says why the engine can no longer be trusted, and the process then
    exits without renewing."""
    from scheduler.worker.host import start_host

    _early_stop.install()
    # Until the engine is loaded and the lease renewed, the probe must fail.
    liveness.forget(settings.liveness_file)
    # What this worker's host records (`scheduler.metrics`). Bound first: a port taken stops
    # the worker before it registers, so beat never counts it as a failover.
    metrics.serve_port(settings)
    clock = SystemClock()
    database = Database(settings.resolved_database_url)
    store = open_store(settings)
    assert settings.redis_url is not None
    notifier = RedisNotifier(settings.redis_url)
    host = start_host(
        settings,
        database,
        clock,
        store,
        notifier,
        worker_id=worker_id,
        models=models,
        distributed=True,
        engine=engine,
        group_size=group_size,
    )
    install_host(host)
    stop = threading.Event()
    # The lease is renewed until the hand-over is done: a lapse in between would let beat move
    # the runs while this worker still saves them.
    lease_done = threading.Event()
    draining, leaving = threading.Event(), threading.Event()

    def keep_lease() -> None:
        # Its own thread, so long engine work never lets the lease lapse.
        while not lease_done.wait(settings.worker_lease_seconds / 3):
            reason = stuck() if stuck is not None else None
            if reason is not None:
                # Not renewed: beat declares this worker dead and moves its runs.
                log.error("worker %s is stuck (%s); exiting", worker_id, reason)
                os._exit(3)
            try:
                status = host.renew_lease()
            except Exception:
                log.exception("could not renew the lease; retrying")
                continue
            if status is WorkerStatus.LEFT and leaving.is_set():
                return  # the hand-over has marked it left
            if status in (None, WorkerStatus.DEAD, WorkerStatus.LEFT):
                # Its runs were moved elsewhere (or another process under its id left):
                # running them here too would fork them.
                log.error("worker %s is %s in the database; exiting", worker_id, status or "gone")
                os._exit(3)
            liveness.touch(settings.liveness_file)
            if status is WorkerStatus.DRAINING and not draining.is_set():
                # Asked to drain (`treadle-server admin workers drain`): stop as on SIGTERM,
                # which hands the runs over on the way out.
                draining.set()
                log.info("worker %s asked to drain; stopping", worker_id)
                os.kill(os.getpid(), signal.SIGTERM)

    def poll() -> None:
        while not stop.wait(POLL_SECONDS):
            try:
                host.drain()
            except Exception:
                log.exception("worker poll failed; continuing")

    def stop_claiming(**_: object) -> None:
        # Celery's warm shutdown waits for the task in progress: a drain() that, under steady
        # traffic, would step and claim for ever. Stopped, it gives back what is in flight.
        host.stop()

    worker_shutting_down.connect(stop_claiming, weak=False)
    threading.Thread(target=keep_lease, name="treadle-lease", daemon=True).start()
    threading.Thread(target=poll, name="treadle-poll", daemon=True).start()
    # This machine's copies of artifacts: beat, on another machine, cannot remove them.
    cache_job = (stop, database, settings, clock, store)
    threading.Thread(
        target=artifact_cache.keep_trimmed, args=cache_job, name="treadle-cache", daemon=True
    ).start()
    app = make_celery(settings)
    register_tasks(app)
    log.info(
        "worker %s serving %s on %s, queue %s",
        worker_id,
        models,
        host.engine.device,
        worker_queue(worker_id),
    )
    try:
        app.worker_main(
            [
                # No banner: the line above says what this worker serves, and the output stays
                # log lines alone (one JSON object each with TREADLE_LOG_FORMAT=json).
                "--quiet",
                "worker",
                "--pool",
                "solo",
                "--concurrency",
                "1",
                "--queues",
                worker_queue(worker_id),
                "--hostname",
                f"{worker_id}@%h",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ]
        )
    finally:
        stop.set()
        leaving.set()
        hand_over(host, settings, app)
        lease_done.set()


def hand_over(host: WorkerHost, settings: Settings, app: Celery) -> None:
    """Leaving on purpose: finish the step in progress, give back the samples in flight, save
    and unpin the runs, and wake the workers they are placed on, so clients wait for a restore
    rather than for this worker's lease to lapse."""
    from scheduler.dispatch import wake_worker

    started = time.monotonic()
    try:
        wake = host.hand_over(settings)
    except Exception:
        log.exception(
            "handing the runs over failed; they move once this worker's lease lapses instead"
        )
        host.close()
        return
    if wake is None:
        return  # declared dead meanwhile: beat moves the runs
    for target_worker in wake:
        wake_worker(app, target_worker)
    log.info("handed over in %.0f ms", (time.monotonic() - started) * 1000)


# --- worker groups --------------------------------------------------------------------------

# How long a follower waits for rank 0's next command: a worker may sit idle for days, and a
# rank 0 that is gone ends the group through the parent, not through this timeout.
FOLLOWER_IDLE_TIMEOUT = timedelta(days=30)

# How long the parent waits for the other ranks once rank 0 has ended on its own (it sent
# them Exit) before it kills them.
RANK_EXIT_GRACE_SECONDS = 30.0

# The longest the parent of a group goes without running its signal handlers.
SIGNAL_CHECK_SECONDS = 1.0


def group_devices(device: str, size: int, devices: list[str] | None = None) -> list[str]:
    """Each rank's device for a group of `size`: `devices` as given (one per rank), else
    `device` alone for one rank or repeated for `cpu`, else cuda:0..size-1 for `auto` or
    `cuda` (`auto` without a GPU: cpu). Raises ConfigurationError, saying what to change, for
    what cannot work."""
    if devices:
        if len(devices) != size:
            raise ConfigurationError(
                f"--devices names {len(devices)} device(s) for a group of {size}; name one "
                "per rank, e.g. --devices cuda:0,cuda:1"
            )
        return list(devices)
    if size == 1 or device == "cpu":
        return [device] * size
    if device in ("auto", "cuda"):
        from gpu_worker.ranks import cuda_device_count

        count = cuda_device_count()
        if count:
            if count < size:
                raise ConfigurationError(
                    f"a group of {size} needs {size} GPUs and this machine has {count}; "
                    "lower --group-size"
                )
            return [f"cuda:{rank}" for rank in range(size)]
        if device == "auto":
            return ["cpu"] * size
        raise ConfigurationError("--device cuda but this machine has no CUDA device")
    raise ConfigurationError(
        f"--device {device} names one device and --group-size is {size}; name one device "
        "per rank with --devices, e.g. --devices cuda:0,cuda:1"
    )


def devices_needed(settings: Settings, name: str) -> int:
    """The devices model `name` (an alias: the model it names, as the engine's catalog
    resolves it) needs: what `TREADLE_MODEL_DEVICES` gives its model folder, else 1."""
    return settings.model_devices.get(settings.model_aliases.get(name, name), 1)


def check_models(settings: Settings, models: list[str], group_size: int) -> None:
    """Refuse, saying what to change, to serve a model that needs more devices
    (`TREADLE_MODEL_DEVICES`) than this worker has ranks, a device count for a model that is
    not a model folder (built-in models use one device), or, in a group that shards its base
    (`shards_base`), a model folder whose unembedding is tied to its embeddings, which a
    sharded engine cannot serve (every rank would fail at start, and the group restart for
    ever otherwise)."""
    stray = sorted(set(settings.model_devices) - set(settings.model_folders))
    if stray:
        raise ConfigurationError(
            f"TREADLE_MODEL_DEVICES names {', '.join(stray)}, not in TREADLE_MODEL_FOLDERS; "
            "give devices for model folders only (built-in models use one device)"
        )
    for name in models:
        needed = devices_needed(settings, name)
        if needed > group_size:
            raise ConfigurationError(
                f"{name} needs a worker group of {needed} devices (TREADLE_MODEL_DEVICES) and "
                f"this worker has {group_size}; start it with --group-size {needed} or more, "
                f"or leave {name} out of its models"
            )
    if not shards_base(settings, models):
        return
    big = next(name for name in models if devices_needed(settings, name) > 1)
    for name in models:
        folder = settings.model_folders.get(settings.model_aliases.get(name, name))
        if folder is None or not _ties_embeddings(Path(folder)):
            continue
        tied = (
            f"{name}'s unembedding is tied to its embeddings (tie_word_embeddings in "
            f"{Path(folder) / 'config.json'}), which a sharded base does not support"
        )
        if devices_needed(settings, name) > 1:
            raise ConfigurationError(
                f"{name} needs {devices_needed(settings, name)} devices "
                f"(TREADLE_MODEL_DEVICES), so its group shards its base weights, but {tied}; "
                f"serve {name} with one device (leave it out of TREADLE_MODEL_DEVICES)"
            )
        raise ConfigurationError(
            f"this group shards its base weights, every model's, since {big} needs several "
            f"devices (TREADLE_MODEL_DEVICES), but {tied}; serve {name} on workers that do "
            f"not serve {big}"
        )


def _ties_embeddings(folder: Path) -> bool:
    """Whether the model folder's config.json says `"tie_word_embeddings": true` (read as
    JSON: this side of the worker loads no model library). A folder without a readable
    config is left to the engine, which says what is wrong with it."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("tie_word_embeddings") is True


def shards_base(settings: Settings, models: list[str]) -> bool:
    """Whether a group serving `models` shards its base weights over its ranks (FSDP2): when
    one of them needs more than one device (`TREADLE_MODEL_DEVICES`), which says that it does
    not fit one. Every model the group serves is then sharded, the others too: sharding is
    the engine's, not a model's."""
    return any(devices_needed(settings, name) > 1 for name in models)


class _Watched:
    """Rank 0's GroupEngine as its host sees it: each call is timed, so the lease thread can
    tell a command stuck in flight, and a call that finds the group failed (a rank diverged
    or a collective failed) ends the process, so the whole group restarts and its runs are
    restored elsewhere, rather than the host failing op after op on a broken group."""

    def __init__(self, group: GroupEngine) -> None:
        self._group = group
        self._lock = threading.Lock()
        self._started: dict[int, float] = {}
        self._tokens = itertools.count()

    def __getattr__(self, name: str) -> Any:
        from gpu_worker.group import GroupFailed

        value = getattr(self._group, name)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            token = next(self._tokens)
            with self._lock:
                self._started[token] = time.monotonic()
            try:
                return value(*args, **kwargs)
            except GroupFailed as exc:
                log.error("worker group failed (%s); exiting", exc)
                os._exit(3)
            finally:
                with self._lock:
                    del self._started[token]

        return call

    def busy_seconds(self) -> float:
        """How long the oldest call in flight has run (0 with none)."""
        with self._lock:
            oldest = min(self._started.values(), default=None)
        return 0.0 if oldest is None else time.monotonic() - oldest


def _rank_main(
    rank: int,
    settings: Settings,
    worker_id: str,
    models: list[str],
    devices: list[str],
    init_method: str,
) -> None:
    """One rank of a group, in its own (spawned) process."""
    from core import logs

    logs.configure(settings)
    try:
        _rank_life(rank, settings, worker_id, models, devices, init_method)
    except Exception:
        log.exception("worker %s rank %d failed", worker_id, rank)
        raise


def _rank_life(
    rank: int,
    settings: Settings,
    worker_id: str,
    models: list[str],
    devices: list[str],
    init_method: str,
) -> None:
    from gpu_worker.ranks import join_group, leave_group

    if rank > 0:
        # Rank 0 alone stops on a signal (it hands the runs over, then tells the others to
        # exit); a follower stopping first would only break the hand-over's last steps.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    else:
        # A stop while the ranks connect and load is held until rank 0's worker is ready.
        _early_stop.install()
    device = devices[rank]
    log.info(
        "worker %s rank %d of %d on %s: pid %d", worker_id, rank, len(devices), device, os.getpid()
    )
    settings = settings.model_copy(update={"device": device})
    join_group(rank, devices, init_method, timedelta(seconds=settings.group_timeout_seconds))
    try:
        _serve_rank(rank, settings, worker_id, models, len(devices))
    finally:
        leave_group()


def _serve_rank(
    rank: int, settings: Settings, worker_id: str, models: list[str], group_size: int
) -> None:
    from gpu_worker.group import GroupComm, GroupEngine, follow
    from scheduler.worker.host import build_engine

    engine = build_engine(settings, preload=models, shard_base=shards_base(settings, models))
    comm = GroupComm(idle_timeout=FOLLOWER_IDLE_TIMEOUT)
    if rank > 0:
        follow(engine, comm)
        return
    group = GroupEngine(engine, comm)
    watched = _Watched(group)

    def stuck() -> str | None:
        busy = watched.busy_seconds()
        if busy > settings.group_timeout_seconds:
            return f"a group command has been in flight for {busy:.0f} s"
        return None

    try:
        run_worker(
            settings,
            worker_id=worker_id,
            models=models,
            engine=cast("Engine", watched),
            group_size=group_size,
            stuck=stuck,
        )
    finally:
        group.close()


def run_worker_group(
    settings: Settings, *, worker_id: str, models: list[str], devices: list[str]
) -> int:
    """Run a worker group of `len(devices)` ranks until it ends; returns the exit status.

    The ranks are spawned processes. Rank 0 is the worker the control plane sees; the parent
    forwards SIGTERM to it alone, so a stop hands the runs over as a plain worker's does. When
    any rank ends with an error (killed, out of memory, a failed collective) the parent kills
    the others at once and returns non-zero: rank 0's lease lapses and beat moves its runs, as
    for one dead worker. Nothing is saved from a group with a rank gone, whose replicas may no
    longer agree. A SIGTERM while the ranks are being started kills them once they are, and
    returns 0: rank 0 has registered nothing yet.
    """
    # The handlers come first: a SIGTERM while the ranks start would otherwise end this
    # process alone and leave them running. Handlers, not SIG_IGN, which a spawned rank
    # would inherit.
    ranks: list[BaseProcess] = []
    stopped_early = threading.Event()

    def forward(signum: int, _frame: object) -> None:
        if not ranks:
            stopped_early.set()  # the ranks are stopped as soon as they are known
        elif ranks[0].is_alive() and ranks[0].pid is not None:
            os.kill(ranks[0].pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    # Ctrl-C reaches every rank from the terminal; rank 0 stops on it and the others ignore it.
    signal.signal(signal.SIGINT, lambda signum, frame: None)

    from gpu_worker.ranks import spawn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks.extend(
        spawn(
            _rank_main,
            (settings, worker_id, models, devices, f"tcp://127.0.0.1:{port}"),
            len(devices),
        )
    )
    log.info("worker group %s: ranks %s on %s", worker_id, [p.pid for p in ranks], devices)
    if stopped_early.is_set():
        # Stopped before rank 0 could register: nothing to hand over.
        log.info("worker group %s: stopped while starting; ending its ranks", worker_id)
        _kill(ranks)
        return 0
    status = 0
    grace_until: float | None = None
    while any(p.exitcode is None for p in ranks):
        # Bounded, as a SIGTERM landing just before the wait starts has its handler run only
        # once the wait returns.
        timeout = SIGNAL_CHECK_SECONDS
        if grace_until is not None:
            timeout = min(timeout, max(0.0, grace_until - time.monotonic()))
        multiprocessing.connection.wait(
            [p.sentinel for p in ranks if p.exitcode is None], timeout=timeout
        )
        failed = [(rank, p.exitcode) for rank, p in enumerate(ranks) if p.exitcode not in (None, 0)]
        late = grace_until is not None and time.monotonic() >= grace_until
        if failed or late:
            if failed:
                rank, code = failed[0]
                assert code is not None
                log.error(
                    "worker group %s: rank %d ended (%s); stopping the group",
                    worker_id,
                    rank,
                    f"signal {-code}" if code < 0 else f"exit status {code}",
                )
                status = 128 - code if code < 0 else code
            else:
                log.error(
                    "worker group %s: ranks did not exit after rank 0; killing them", worker_id
                )
                status = 1
            _kill(ranks)
            break
        if grace_until is None and ranks[0].exitcode == 0:
            grace_until = time.monotonic() + RANK_EXIT_GRACE_SECONDS
    return status


def _kill(ranks: list[BaseProcess]) -> None:
    """Kill the ranks still running and wait for them all."""
    for p in ranks:
        if p.exitcode is None and p.pid is not None:
            os.kill(p.pid, signal.SIGKILL)
    for p in ranks:
        p.join()
