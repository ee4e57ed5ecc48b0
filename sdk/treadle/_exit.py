"""Ending sessions when the process exits without `ServiceClient.close()`.

An open session holds one slot of the tenant's concurrent-session quota until it is finished or
its heartbeats have been missing for the server's idle timeout. So that a script which ends by
an uncaught exception, Ctrl-C or SIGTERM does not lock its owner out, every open session is
finished at exit, best effort (a few seconds at most; the idle timeout remains the backstop):

* an exit hook covers a normal exit, an uncaught exception and Ctrl-C (KeyboardInterrupt ends
  the interpreter normally). It runs in `threading`'s exit hooks, before Python stops the
  thread pools the event loop resolves host names with;
* SIGTERM and SIGINT, whose default action kills the process without running atexit handlers,
  get a handler (installed from the main thread, when a ServiceClient is created) that
  finishes the sessions and then does what the previous handler would have done: it calls a
  previous Python handler (Python's own SIGINT handler raises KeyboardInterrupt, which is never
  swallowed), or restores the default action and re-sends the signal. Sessions are not
  finished before a previous Python handler runs, since it may keep the process alive (to save
  a checkpoint, say); atexit finishes them when the process does exit. Ignored signals stay
  ignored.

Only sessions created by this process are finished: a forked child leaves its parent's alone.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import concurrent.futures.thread  # its exit hook must be registered before ours
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from treadle._session import FinishStatus, Session

logger = logging.getLogger("treadle")

EXIT_FINISH_SECONDS = 5.0
"""The most time spent finishing one session at exit."""

_lock = threading.Lock()
_open: dict[int, tuple[int, Session]] = {}
_installed = False
_signals_installed = False
_handled_signals = (signal.SIGINT, signal.SIGTERM)
_previous: dict[int, Any] = {}
_received: list[str] = []
"""Signals handed on to a previous handler, for the finish reason at exit."""


def register(session: Session) -> None:
    """Finish `session` at exit unless it is finished before."""
    with _lock:
        _open[id(session)] = (os.getpid(), session)


def unregister(session: Session) -> None:
    with _lock:
        _open.pop(id(session), None)


def install() -> None:
    """Register the exit hook (once) and, from the main thread, the signal handlers (once)."""
    global _installed, _signals_installed
    with _lock:
        hook_needed, _installed = not _installed, True
        signals_needed = (
            not _signals_installed and threading.current_thread() is threading.main_thread()
        )
        _signals_installed = _signals_installed or signals_needed
    if hook_needed:
        register_hook = getattr(threading, "_register_atexit", None)
        try:
            if register_hook is None:
                raise RuntimeError("threading has no exit hooks")
            register_hook(_at_exit)
        except RuntimeError:
            atexit.register(_at_exit)
    if not signals_needed:
        return
    for signum in _handled_signals:
        try:
            previous = signal.getsignal(signum)
            if previous in (signal.SIG_IGN, None):
                continue  # ignored, or set outside Python: leave it alone
            _previous[signum] = previous
            signal.signal(signum, _on_signal)
        except (ValueError, OSError):  # not the main interpreter, or an unusual platform
            continue


def finish_all(status: FinishStatus, detail: str) -> None:
    """Finish every open session of this process, all at once, waiting a few seconds at most."""
    with _lock:
        mine = [session for pid, session in _open.values() if pid == os.getpid()]
    pending: dict[concurrent.futures.Future[None], Session] = {}
    for session in mine:
        unregister(session)
        connection = session.connection
        if connection.closed or connection.loop.in_loop_thread():
            continue
        try:
            finishing = session.finish(status, detail, max_seconds=EXIT_FINISH_SECONDS)
            pending[connection.loop.spawn(finishing)] = session
        except RuntimeError:  # its loop is already closed
            continue
    _, late = concurrent.futures.wait(pending, timeout=EXIT_FINISH_SECONDS + 1)
    for future in late:
        future.cancel()
    for future, session in pending.items():
        if future in late or future.cancelled():
            error: BaseException | None = TimeoutError("no answer in time")
        else:
            error = future.exception()
        if error is not None:  # best effort: the server's idle timeout is the backstop
            logger.warning("could not finish session %s at exit: %r", session.session_id, error)


def _at_exit() -> None:
    last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if isinstance(last, KeyboardInterrupt):
        finish_all("interrupted", "the process was interrupted (KeyboardInterrupt)")
    elif last is not None:
        finish_all("errored", f"the process exited on {last!r}"[:500])
    elif _received:
        finish_all("interrupted", f"the process exited after receiving {_received[-1]}")
    else:
        finish_all("success", "the process exited without ServiceClient.close()")


def _on_signal(signum: int, frame: FrameType | None) -> None:
    previous = _previous.get(signum, signal.SIG_DFL)
    name = signal.Signals(signum).name
    if callable(previous):
        _received.append(name)
        handler: Callable[[int, FrameType | None], Any] = previous
        handler(signum, frame)
        return
    finish_all("interrupted", f"the process received {name}")
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
