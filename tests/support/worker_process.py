"""Real `dynamo-worker` processes on loopback, for end-to-end tests and benchmarks.

`WorkerProcess` starts `python -m dynamo.runtime.cli` (the `dynamo-worker` console script's
module), or another command that runs it such as `docker run IMAGE`, with ephemeral ports on
127.0.0.1, reads its log to learn the bound ports, and offers async helpers that await
conditions (health status, process exit) instead of sleeping.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import aiohttp
import pytest

_LISTENING = re.compile(r"(System status server|Request plane) listening on (http://\S+)")
SAMPLE_ENGINE = "dynamo.engines.sample:SampleEngine"
# What every test worker runs with: loopback, ephemeral ports, in-memory discovery.
LOOPBACK_ENV = {
    "DYN_SYSTEM_HOST": "127.0.0.1",
    "DYN_SYSTEM_PORT": "0",
    "DYN_HTTP_HOST": "127.0.0.1",
    "DYN_HTTP_PORT": "0",
    "DYN_DISCOVERY_BACKEND": "mem",
    # No grace period unless a test asks for one: shutdown is then immediate.
    "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0",
    "PYTHONUNBUFFERED": "1",
}


class WorkerProcess:
    """One worker process and what its log said."""

    def __init__(
        self,
        args: Sequence[str],
        env: Mapping[str, str] | None = None,
        command: Sequence[str] = (sys.executable, "-m", "dynamo.runtime.cli"),
    ) -> None:
        full_env = {**os.environ, **LOOPBACK_ENV, **(env or {})}
        self.command = [*command, *args]
        self.process = subprocess.Popen(
            self.command,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._urls: dict[str, str] = {}
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                match = _LISTENING.search(line)
                if match:
                    self._urls[match.group(1)] = match.group(2)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def log(self) -> str:
        """Everything the worker printed so far."""
        with self._changed:
            return "\n".join(self.lines)

    def _wait_url(self, which: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        with self._changed:
            while which not in self._urls:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (
                    self.process.poll() is not None and not self._reader.is_alive()
                ):
                    raise AssertionError(f"worker never logged its {which} URL:\n{self.log()}")
                self._changed.wait(min(remaining, 0.5))
            return self._urls[which]

    def system_url(self, timeout: float = 60) -> str:
        """`http://127.0.0.1:<port>` of the system status server."""
        return self._wait_url("System status server", timeout)

    def http_url(self, timeout: float = 60) -> str:
        """`http://127.0.0.1:<port>` of the request plane."""
        return self._wait_url("Request plane", timeout)

    async def wait_health(self, status: int, within: float = 60) -> None:
        """Poll `/health` until it answers `status`."""
        url = await asyncio.to_thread(self.system_url, within)
        deadline = time.monotonic() + within
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    async with session.get(url + "/health") as response:
                        if response.status == status:
                            return
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise AssertionError(f"/health never answered {status}:\n{self.log()}")
                await asyncio.sleep(0.02)

    def terminate(self) -> None:
        """Send SIGTERM."""
        self.process.send_signal(signal.SIGTERM)

    async def wait_exit(self, within: float = 60) -> int:
        """Wait for the process to exit; its exit code."""
        try:
            return await asyncio.to_thread(self.process.wait, within)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker did not exit within {within} s:\n{self.log()}") from None

    def close(self) -> None:
        """Kill the process if it still runs."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)
        self._reader.join(10)


WorkerFactory = Callable[..., WorkerProcess]


@pytest.fixture
def worker_factory() -> Iterator[WorkerFactory]:
    """Start workers with `worker_factory(*args, env=...)`; all are killed at the end."""
    started: list[WorkerProcess] = []

    def start(*args: str, env: Mapping[str, str] | None = None) -> WorkerProcess:
        worker = WorkerProcess(args, env)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.close()
