"""A distributed Treadle on this machine: API replicas, workers and beat as real processes,
on a throwaway PostgreSQL database and a private Redis database number."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import redis

from tests.services import free_port

CLI = str(Path(sys.executable).with_name("treadle-server"))
SECRET = "cluster-test-secret-0123456789"


@dataclasses.dataclass
class Cluster:
    env: dict[str, str]
    root: Path
    apis: dict[str, subprocess.Popen[bytes]] = dataclasses.field(default_factory=dict)
    api_urls: dict[str, str] = dataclasses.field(default_factory=dict)
    workers: dict[str, subprocess.Popen[bytes]] = dataclasses.field(default_factory=dict)
    beat: subprocess.Popen[bytes] | None = None
    # What each process was given beyond the cluster's environment, by name: a test reads its
    # metrics port or liveness file there, and starts it again the same way.
    extra_env: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    # Each process keeps its own data folder (as on separate machines) instead of sharing one.
    private_data: bool = False

    def spawn(
        self, name: str, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """`treadle-server *args`, logging to `<name>.log`, with `env` added to the cluster's."""
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115  (kept open for the process)
        self.extra_env[name] = dict(env or {})
        env = {**self.env, **(env or {})}
        if self.private_data:
            env = {**env, "TREADLE_DATA_DIR": str(self.root / f"data-{name}")}
        return subprocess.Popen(
            [CLI, *args], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def start_api(self, name: str) -> str:
        port = free_port()
        self.apis[name] = self.spawn(name, "api", "--port", str(port))
        url = f"http://127.0.0.1:{port}"
        _wait_http(f"{url}/api/v1/healthz", self.root / f"{name}.log")
        self.api_urls[name] = url
        return url

    def start_worker(self, name: str, *models: str, env: dict[str, str] | None = None) -> None:
        """`env` is added to the cluster's for this worker alone (its metrics port, its
        liveness file)."""
        args = ["worker", "--device", "cpu", "--worker-id", name]
        for model in models or ("treadle/tiny-1m",):
            args += ["--models", model]
        self.workers[name] = self.spawn(name, *args, env=env)

    def start_beat(self, env: dict[str, str] | None = None) -> None:
        self.beat = self.spawn("beat", "beat", env=env)

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for proc in [
            *self.apis.values(),
            *self.workers.values(),
            *([self.beat] if self.beat else []),
        ]:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in [
            *self.apis.values(),
            *self.workers.values(),
            *([self.beat] if self.beat else []),
        ]:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def _wait_http(url: str, log: Path, seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up:\n{log.read_text(errors='replace')[-3000:]}")


@contextlib.contextmanager
def cluster(
    root: Path,
    postgres_url: str,
    redis_url: str,
    *,
    s3: tuple[str, dict[str, str]] | None = None,
    **settings: str,
) -> Iterator[Cluster]:
    """`s3` is an artifact URL with the environment that reaches it: the processes then share
    no folder at all, each keeping its own data folder."""
    db_number = random.randint(1, 15)
    redis_db = f"{redis_url}/{db_number}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TREADLE_")}
    env.update(
        TREADLE_DATABASE_URL=postgres_url,
        TREADLE_REDIS_URL=redis_db,
        TREADLE_SERVER_SECRET=SECRET,
        TREADLE_ARTIFACT_URL=str(root / "artifacts"),
        TREADLE_DATA_DIR=str(root / "data"),
        TREADLE_TORCH_THREADS="1",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        **{f"TREADLE_{k.upper()}": v for k, v in settings.items()},
    )
    if s3 is not None:
        url, s3_env = s3
        env.update(s3_env, TREADLE_ARTIFACT_URL=url)
    subprocess.run([CLI, "migrate"], env=env, check=True, capture_output=True, timeout=120)
    group = Cluster(env=env, root=root, private_data=s3 is not None)
    try:
        yield group
    finally:
        group.stop()
        redis.Redis.from_url(redis_db).flushdb()


class FailoverProxy:
    """A TCP load balancer for the API tier: each new connection goes to the next backend in
    rotation that accepts it, so clients keep working when a replica dies.

    With `drop_rate`, each chunk of a response is, with that probability, the last: the proxy
    cuts the connection there, as a flaky network would (`dropped` counts the cuts).
    """

    def __init__(self, backends: list[str], drop_rate: float = 0.0, seed: int = 0) -> None:
        import asyncio
        import threading

        self.backends = [
            (u.split("//")[1].split(":")[0], int(u.rsplit(":", 1)[1])) for u in backends
        ]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._next = 0
        self.drop_rate = drop_rate
        self.dropped = 0
        self._random = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            server = self._loop.run_until_complete(
                asyncio.start_server(self._handle, "127.0.0.1", self.port)
            )
            started.set()
            self._loop.run_forever()
            server.close()

        threading.Thread(target=run, name="failover-proxy", daemon=True).start()
        started.wait(10)

    async def _handle(self, reader: object, writer: object) -> None:
        import asyncio

        assert isinstance(reader, asyncio.StreamReader) and isinstance(writer, asyncio.StreamWriter)
        for _ in range(len(self.backends)):
            host, port = self.backends[self._next % len(self.backends)]
            self._next += 1
            try:
                up_reader, up_writer = await asyncio.open_connection(host, port)
                break
            except OSError:
                continue
        else:
            writer.close()
            return

        async def pipe(
            src: asyncio.StreamReader, dst: asyncio.StreamWriter, flaky: bool = False
        ) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    if flaky and self.drop_rate and self._random.random() < self.drop_rate:
                        self.dropped += 1
                        up_writer.close()
                        break
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer, flaky=True))

    def close(self) -> None:
        import asyncio

        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks(self._loop) if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop)
