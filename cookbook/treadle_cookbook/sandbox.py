"""Run untrusted, model-written Python in a child process with limits.

Code RL grades completions by running them, so a completion may loop forever, allocate all
memory, fork without end, open connections or write over the host's files. `run_python` runs
one program against one stdin and contains each of those:

- time: a wall-clock deadline enforced here, and RLIMIT_CPU in the child (SIGXCPU, then SIGKILL);
- memory: RLIMIT_AS (an allocation past it fails with MemoryError in the child);
- processes: RLIMIT_NPROC. Linux counts it per user, and never enforces it for root, so when this
  process is root the child runs as a dedicated unprivileged uid (`nobody`, 65534, by default).
  Every sandbox with the same uid shares that count: run them one at a time, or give concurrent
  sandboxes distinct uids;
- file size: RLIMIT_FSIZE (Python ignores SIGXFSZ, so a write past it fails with EFBIG);
- network: when root, a new, empty network namespace (only a loopback that is down). Without
  root the child tries an unprivileged user namespace for the same; where neither is possible
  an audit hook refuses sockets and process launches inside the Python interpreter. That
  fallback is weaker: native code (ctypes, an extension module) goes around it;
- files: a private working folder (the cwd, HOME and TMPDIR), removed afterwards. When root,
  the uid cannot write the host's folders, and /tmp, /var/tmp and /dev/shm, which every uid
  can write, are fresh, small tmpfs mounts in a private mount namespace, with the working folder
  bound back in at its own path. Without root the child writes wherever this process's user can;
- output: stdout and stderr are read up to a cap; a program that writes more is killed;
- cleanup: the child leads its own process group, killed with SIGKILL at the end. A process that
  leaves the group with setsid() escapes that kill, though not its CPU limit.

The interpreter is the system's `python3` when this process's own interpreter lies in a folder
the sandbox uid cannot enter (a pyenv under /root); pass `python=` to choose. It starts with
`-I -S`: the standard library only, no site-packages, no environment variables read.

This module knows nothing of problems, tests or rewards: see `code_tasks`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

NetworkIsolation = Literal["namespace", "audit_hook"]

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_PRIVATE = 0x40000
_SHARED_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")
_EXEC_RETRIES = 40

# Runs first in the child: optionally installs the socket guard, then runs the program as
# __main__ so tracebacks name solution.py.
_LAUNCHER = """
import runpy, sys
if sys.argv[1] == "guard":
    _DENIED = ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
               "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.system")
    def _guard(event, args):
        if event in _DENIED:
            raise PermissionError(f"{event} is not allowed in this sandbox")
    sys.addaudithook(_guard)
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@dataclass(frozen=True)
class Limits:
    """What one run may use. Sizes in bytes, times in seconds."""

    wall_time_s: float = 5.0
    cpu_time_s: int = 4
    memory_bytes: int = 512 * 2**20
    processes: int = 32
    file_size_bytes: int = 2**20
    output_bytes: int = 64 * 2**10
    tmpfs_bytes: int = 16 * 2**20
    uid: int = 65534
    gid: int = 65534


@dataclass(frozen=True)
class SandboxResult:
    """How a run ended. `exit_code` is negative when a signal ended the child (-9: SIGKILL)."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    kill_reason: str | None  # wall_time, cpu_time, file_size, output_limit, or "signal NAME"
    output_truncated: bool
    network: NetworkIsolation

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.kill_reason is None


def run_python(
    code: str,
    stdin: str = "",
    limits: Limits = Limits(),
    *,
    python: str | None = None,
    network: NetworkIsolation | None = None,
) -> SandboxResult:
    """Run `code` as a program reading `stdin`; `network` forces one isolation (tests use it)."""
    as_root = os.geteuid() == 0
    network = network or ("namespace" if _namespaces_work(as_root) else "audit_hook")
    workdir = Path(tempfile.mkdtemp(prefix="treadle-sandbox-"))
    try:
        (workdir / "solution.py").write_text(code)
        if as_root:
            os.chown(workdir, limits.uid, limits.gid)
            os.chown(workdir / "solution.py", limits.uid, limits.gid)
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(workdir),
            "TMPDIR": str(workdir),
            "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8",
        }
        argv = [
            python or _interpreter(),
            "-I",
            "-S",
            "-c",
            _LAUNCHER,
            "guard" if network == "audit_hook" else "open",
            "solution.py",
        ]
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin.encode())
            stdin_file.seek(0)
            child = _start(
                argv, stdin_file, workdir, env, _child_setup(limits, workdir, as_root, network)
            )
            return _supervise(child, limits, network)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _start(
    argv: list[str], stdin: IO[bytes], workdir: Path, env: dict[str, str], setup: Callable[[], None]
) -> subprocess.Popen[bytes]:
    """Start the child. exec fails with EAGAIN while the sandbox uid is over its process limit,
    which the last run's killed processes hold until they are reaped: wait briefly for that."""
    for _ in range(_EXEC_RETRIES):
        try:
            return subprocess.Popen(
                argv,
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env=env,
                start_new_session=True,
                preexec_fn=setup,
            )
        except BlockingIOError:
            time.sleep(0.05)
    raise RuntimeError(
        f"the sandbox uid stayed at its process limit for {_EXEC_RETRIES * 0.05:.0f} s: "
        "run sandboxes sharing a uid one at a time, or give each a distinct Limits.uid"
    )


def _supervise(
    child: subprocess.Popen[bytes], limits: Limits, network: NetworkIsolation
) -> SandboxResult:
    assert child.stdout is not None and child.stderr is not None
    out_fd, err_fd = child.stdout.fileno(), child.stderr.fileno()
    captured = {out_fd: bytearray(), err_fd: bytearray()}
    selector = selectors.DefaultSelector()
    for stream in (child.stdout, child.stderr):
        selector.register(stream, selectors.EVENT_READ)
    deadline = time.monotonic() + limits.wall_time_s
    our_reason: str | None = None
    truncated = False
    while selector.get_map() and our_reason is None:
        if child.poll() is not None:
            # Grandchildren may hold the pipes open; they end with the group.
            _kill_group(child.pid)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            our_reason = "wall_time"
            break
        for key, _ in selector.select(timeout=min(remaining, 0.1)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                selector.unregister(key.fileobj)
                continue
            buffer = captured[key.fd]
            buffer.extend(chunk[: max(0, limits.output_bytes - len(buffer))])
            if len(buffer) >= limits.output_bytes:
                truncated = True
                our_reason = "output_limit"
    selector.close()
    _kill_group(child.pid)
    exit_code = child.wait()
    child.stdout.close()
    child.stderr.close()
    reason = our_reason or _signal_reason(exit_code)
    return SandboxResult(
        exit_code=exit_code,
        stdout=captured[out_fd].decode(errors="replace"),
        stderr=captured[err_fd].decode(errors="replace"),
        timed_out=reason in ("wall_time", "cpu_time"),
        kill_reason=reason,
        output_truncated=truncated,
        network=network,
    )


def _signal_reason(exit_code: int) -> str | None:
    if exit_code >= 0:
        return None
    signum = -exit_code
    if signum in (signal.SIGXCPU, signal.SIGKILL):
        # Nothing here sent SIGKILL before the child ended, so the kernel did: RLIMIT_CPU's hard
        # limit.
        return "cpu_time"
    if signum == signal.SIGXFSZ:
        return "file_size"
    return f"signal {signal.Signals(signum).name}"


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _child_setup(
    limits: Limits, workdir: Path, as_root: bool, network: NetworkIsolation
) -> Callable[[], None]:
    """The function the forked child runs before exec. Order matters: namespaces and mounts need
    root's capabilities, so they come before the limits and the switch to the sandbox uid."""

    def setup() -> None:
        if network == "namespace":
            if as_root:
                _unshare(_CLONE_NEWNET | _CLONE_NEWNS)
                _private_shared_folders(workdir, limits.tmpfs_bytes)
            else:
                _unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
        cpu = limits.cpu_time_s
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size_bytes,) * 2)
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.umask(0o077)
        if as_root:
            os.setgroups([])
            os.setgid(limits.gid)
            os.setuid(limits.uid)

    return setup


def _private_shared_folders(workdir: Path, size_bytes: int) -> None:
    """Cover the world-writable folders with fresh tmpfs mounts, then bind the working folder
    (which lies in one of them) back at its own path, from a descriptor opened before."""
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    held = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
    for folder in _SHARED_WRITABLE:
        if os.path.isdir(folder):
            _mount("tmpfs", folder, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={size_bytes},mode=1777")
    os.makedirs(workdir, exist_ok=True)
    _mount(f"/proc/self/fd/{held}", str(workdir), None, _MS_BIND)
    os.close(held)
    os.chdir(workdir)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _unshare(flags: int) -> None:
    if _libc().unshare(flags) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare({flags:#x}): {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    encoded = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    if _libc().mount(encoded[0], encoded[1], encoded[2], flags, encoded[3]) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source} on {target}: {os.strerror(errno)}")


@functools.cache
def _namespaces_work(as_root: bool) -> bool:
    """Whether this machine lets a child enter new namespaces (containers often refuse)."""
    flags = _CLONE_NEWNET | (_CLONE_NEWNS if as_root else _CLONE_NEWUSER)
    try:
        subprocess.run(["/bin/true"], preexec_fn=lambda: _unshare(flags), check=True)
    except (subprocess.SubprocessError, OSError):
        return False
    return True


@functools.cache
def _interpreter() -> str:
    own = os.path.realpath(sys.executable)
    if os.geteuid() != 0 or _world_executable(own):
        return own
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if system is None or not _world_executable(os.path.realpath(system)):
        raise RuntimeError(
            f"the sandbox uid cannot run {own} (a folder on its path is closed to other users) "
            "and no system python3 was found; pass python= an interpreter every user can run"
        )
    return system


def _world_executable(path: str) -> bool:
    """Whether another user can reach and run `path`: every folder above it searchable."""
    current = Path(path)
    if not current.stat().st_mode & stat.S_IXOTH:
        return False
    return all(parent.stat().st_mode & stat.S_IXOTH for parent in current.parents)
