"""Run untrusted, model-written Python in a child process with limits.

Code RL grades completions by running them, so a completion may loop forever, allocate all
memory, fork without end, leave processes behind, open connections or write over the host's
files. `run_python` runs one program against one stdin and contains each of those:

- time: a wall-clock deadline enforced here, and RLIMIT_CPU in the child (SIGKILL a second
  past it; the program ignores SIGXCPU as pid 1 of its namespace, and gets it first without);
- memory: RLIMIT_AS (an allocation past it fails with MemoryError). It holds per process and
  no cgroup caps a run in total, so a run reserves at most `Limits.total_memory_bytes`, the
  process limit times the memory limit (8 × 512 MiB = 4 GiB by default), plus its tmpfs mounts;
- processes: RLIMIT_NPROC. Linux counts it per user, and never enforces it for root, so when this
  process is root the child runs as a dedicated unprivileged uid (`nobody`, 65534, by default).
  Every sandbox with the same uid shares that count: run them one at a time, or give concurrent
  sandboxes distinct uids;
- leftovers: where namespaces work, the program runs as pid 1 of a new PID namespace, so every
  process it starts, even one that left its session with setsid(), is killed when it ends or is
  killed; it sees only its own processes in /proc (remounted when root). Where namespaces are
  refused, the child leads a process group killed at the end, which setsid() escapes;
- file size: RLIMIT_FSIZE (Python ignores SIGXFSZ, so a write past it fails with EFBIG);
- network: when root, a new, empty network namespace (only a loopback that is down). Without
  root the child tries an unprivileged user namespace for the same; where neither is possible
  an audit hook refuses sockets and process launches inside the Python interpreter. That
  fallback is weaker: native code (ctypes, an extension module) goes around it;
- files: a private working folder (the cwd, HOME and TMPDIR), removed afterwards. When root, in
  a private mount namespace, the working folder is a tmpfs of `Limits.tmpfs_bytes` in total,
  /tmp, /var/tmp, /dev/shm and /run (which every uid can write, or which hold the host's unix
  sockets) are fresh tmpfs mounts of the same size, and the uid cannot write the host's other
  folders. Without root the child writes wherever this process's user can;
- output: stdout and stderr are read up to a cap; a program that writes more is killed.

Nothing runs in the forked child before exec: it execs `_LAUNCHER` in a fresh interpreter,
which enters the namespaces, mounts, sets the limits, drops to the sandbox uid and then execs
the program. (This process may have threads, and a fork of a threaded process must not run
Python.)

The interpreter is the system's `python3` when this process's own interpreter lies in a folder
the sandbox uid cannot enter (a pyenv under /root); pass `python=` to choose. It starts with
`-I -S`: the standard library only, no site-packages, no environment variables read.

This module knows nothing of problems, tests or rewards: see `code_tasks`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

NetworkIsolation = Literal["namespace", "audit_hook"]

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_COVERED = ("/tmp", "/var/tmp", "/dev/shm", "/run")

# Exec'd first, in a fresh single-threaded interpreter: argv[1] is `_plan`'s JSON, the rest the
# program's argv. With namespaces it forks the program's process (pid 1 of the new PID
# namespace) and waits, passing on how it ended; a failure before the program starts is written
# to the `report` descriptor, which the program's exec closes.
_LAUNCHER = r"""
import ctypes, json, os, resource, select, signal, sys, time
plan, program = json.loads(sys.argv[1]), sys.argv[2:]
libc = ctypes.CDLL(None, use_errno=True)
report = plan["report"]
os.set_inheritable(report, False)

def check(ok, what):
    if not ok:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")

def mount(source, target, fstype, flags, data=""):
    args = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    check(libc.mount(args[0], args[1], args[2], flags, args[3]) == 0, f"mount on {target}")

def private_folders(workdir, size, uid, gid):
    nosuid, nodev, noexec, rec, private = 0x2, 0x4, 0x8, 0x4000, 0x40000
    mount(None, "/", None, rec | private)
    mount("proc", "/proc", "proc", nosuid | nodev | noexec)
    host = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
    for folder in plan["cover"]:
        if os.path.isdir(folder):
            mount("tmpfs", folder, "tmpfs", nosuid | nodev, f"size={size},mode=1777")
    os.makedirs(workdir, exist_ok=True)
    mount("tmpfs", workdir, "tmpfs", nosuid | nodev, f"size={size},mode=700,uid={uid},gid={gid}")
    source = os.open("solution.py", os.O_RDONLY, dir_fd=host)
    target = os.path.join(workdir, "solution.py")
    with open(source, "rb") as src, open(target, "wb") as dst:
        dst.write(src.read())
    os.chown(target, uid, gid)
    os.close(host)

def become_program(alive):
    if plan["mount"]:
        private_folders(plan["workdir"], plan["tmpfs_bytes"], plan["uid"], plan["gid"])
    for name, soft, hard in plan["rlimits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    os.umask(0o077)
    if plan["uid"] is not None:
        os.setgroups([])
        os.setgid(plan["gid"])
        os.setuid(plan["uid"])
    if alive is not None:
        # Die with the launcher; set after setuid, which clears it. Readable: it already died.
        check(libc.prctl(1, signal.SIGKILL, 0, 0, 0) == 0, "prctl(PR_SET_PDEATHSIG)")
        if select.select([alive], [], [], 0)[0]:
            os._exit(1)
    os.chdir(plan["workdir"])
    for _ in range(40):
        try:
            os.execv(program[0], program)
        except BlockingIOError:  # the uid is at its process limit until the last run is reaped
            time.sleep(0.05)
    raise RuntimeError(
        "the sandbox uid stayed at its process limit for 2 s: run sandboxes sharing a uid "
        "one at a time, or give each a distinct Limits.uid"
    )

def launch():
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if not plan["unshare"]:
        become_program(None)
    check(libc.unshare(plan["unshare"]) == 0, "unshare")
    alive, held = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(held)
        become_program(alive)
    os.close(report)
    status = os.waitpid(pid, 0)[1]
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    os._exit(os.waitstatus_to_exitcode(status))

try:
    launch()
except BaseException as error:
    os.write(report, f"{type(error).__name__}: {error}".encode())
    os._exit(1)
"""

# The program the launcher execs: optionally installs the socket guard, then runs solution.py
# as __main__ so tracebacks name it.
_RUNNER = """
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
    processes: int = 8
    file_size_bytes: int = 2**20
    output_bytes: int = 64 * 2**10
    tmpfs_bytes: int = 16 * 2**20
    uid: int = 65534
    gid: int = 65534

    @property
    def total_memory_bytes(self) -> int:
        """The most address space a run's processes can hold together (RLIMIT_AS is per process)."""
        return self.processes * self.memory_bytes


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
    """Run `code` as a program reading `stdin`; `network` forces one isolation (tests use it).

    Raises:
        RuntimeError: the launcher could not start the program (a namespace or mount refused,
            the sandbox uid at its process limit); the message says which.
    """
    as_root = os.geteuid() == 0
    python = python or _interpreter()
    network = network or ("namespace" if _namespaces_work(python, as_root) else "audit_hook")
    workdir = Path(tempfile.mkdtemp(prefix="treadle-sandbox-"))
    try:
        (workdir / "solution.py").write_text(code)
        if as_root:
            os.chown(workdir, limits.uid, limits.gid)
            os.chown(workdir / "solution.py", limits.uid, limits.gid)
        program = [python, "-I", "-S", "-c", _RUNNER]
        program += ["guard" if network == "audit_hook" else "open", "solution.py"]
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin.encode())
            stdin_file.seek(0)
            return _run(python, program, stdin_file, workdir, limits, as_root, network)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(
    python: str,
    program: list[str],
    stdin: IO[bytes],
    workdir: Path,
    limits: Limits,
    as_root: bool,
    network: NetworkIsolation,
) -> SandboxResult:
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(workdir),
        "TMPDIR": str(workdir),
        "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
    }
    failure, report = os.pipe()
    plan = json.dumps(_plan(limits, workdir, as_root, network, report))
    try:
        try:
            child = subprocess.Popen(
                [python, "-I", "-S", "-c", _LAUNCHER, plan, *program],
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env=env,
                start_new_session=True,
                pass_fds=(report,),
            )
        finally:
            os.close(report)  # the launcher holds the only copy, so a read ends when it does
        result = _supervise(child, limits, network)
        os.set_blocking(failure, False)
        with contextlib.suppress(BlockingIOError):
            if message := os.read(failure, 4096).decode(errors="replace"):
                raise RuntimeError(f"the sandbox could not start the program: {message}")
        return result
    finally:
        os.close(failure)


def _plan(
    limits: Limits, workdir: Path, as_root: bool, network: NetworkIsolation, report: int
) -> dict[str, object]:
    """What the launcher does before it execs the program: namespaces and mounts need root's
    capabilities, so they come before the limits and the switch to the sandbox uid."""
    flags = 0
    if network == "namespace":
        flags = _CLONE_NEWNET | _CLONE_NEWPID | (_CLONE_NEWNS if as_root else _CLONE_NEWUSER)
    cpu = limits.cpu_time_s
    return {
        "report": report,
        "unshare": flags,
        "mount": as_root and network == "namespace",
        "cover": _COVERED,
        "workdir": str(workdir),
        "tmpfs_bytes": limits.tmpfs_bytes,
        "uid": limits.uid if as_root else None,
        "gid": limits.gid if as_root else None,
        "rlimits": [
            ("RLIMIT_CPU", cpu, cpu + 1),
            ("RLIMIT_AS", limits.memory_bytes, limits.memory_bytes),
            ("RLIMIT_FSIZE", limits.file_size_bytes, limits.file_size_bytes),
            ("RLIMIT_NPROC", limits.processes, limits.processes),
            ("RLIMIT_CORE", 0, 0),
        ],
    }


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
            # Without a PID namespace, grandchildren may hold the pipes open; they end with the
            # group (with one, they ended with the program).
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
    """SIGKILL the launcher's group; with a PID namespace its program dies with the launcher."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@functools.cache
def _namespaces_work(python: str, as_root: bool) -> bool:
    """Whether this machine lets the launcher enter new namespaces and mount (containers often
    refuse): one empty program run with them."""
    try:
        return run_python("", python=python, network="namespace").ok
    except (RuntimeError, OSError):
        return False


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
