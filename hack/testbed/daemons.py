"""Start and stop the test bed's long-running processes by pid file."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from . import cpu_share
from .layout import Layout


def _pid_file(layout: Layout, name: str) -> Path:
    return layout.pids / f"{name}.pid"


def pid_of(layout: Layout, name: str) -> int | None:
    """The pid of a running daemon, or None when it is not running."""
    path = _pid_file(layout, name)
    try:
        pid = int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    # _alive, not a bare kill 0: a daemon that exited while `up` (its parent) still runs is
    # a zombie, which answers kill 0.
    return pid if _alive(pid) else None


def start(layout: Layout, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Start `argv` in its own session with output in logs/<name>.log, in the bed's system
    CPU group (`cpu_share`); no-op if running."""
    running = pid_of(layout, name)
    if running:
        return running
    log = (layout.logs / f"{name}.log").open("ab")
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    cpu_share.place(proc.pid, cpu_share.SYSTEM)
    _pid_file(layout, name).write_text(str(proc.pid))
    return proc.pid


def stop(layout: Layout, name: str, timeout: float = 15.0) -> None:
    """SIGTERM the daemon's process group, then SIGKILL it if it outlives `timeout`."""
    pid = pid_of(layout, name)
    if pid:
        _signal_group(pid, signal.SIGTERM)
        if not wait_for(lambda: not _alive(pid), timeout):
            _signal_group(pid, signal.SIGKILL)
            wait_for(lambda: not _alive(pid), 5.0)
    _pid_file(layout, name).unlink(missing_ok=True)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def _alive(pid: int) -> bool:
    try:
        # Reap it if it is our child (a zombie still answers kill 0).
        if os.waitpid(pid, os.WNOHANG) != (0, 0):
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(condition: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Poll `condition` until it holds or `timeout` seconds pass (for external processes,
    which offer nothing to wait on but their observable state)."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
