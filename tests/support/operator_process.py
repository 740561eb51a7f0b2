"""`dynamo-operator run` as a subprocess against the test bed, with its metrics at hand.

The operator is started the way a user starts it (the console script, KUBECONFIG in the
environment), on free loopback ports; `metrics()` parses its /metrics with prometheus-client's
own parser. Logs go to a file whose tail is shown when a test fails.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import psutil
from prometheus_client.parser import text_string_to_metric_families

from support.cluster import Cluster, eventually

WRITE_VERBS = ("apply", "delete", "patch-status", "create")
CHILD_KINDS = (
    "Deployment",
    "Service",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "PodDisruptionBudget",
    "PodMonitor",
)
TEST_IMAGE = "registry.invalid/dynamo-worker:test"
T = TypeVar("T")


# Test servers' ports come from below the kernel's ephemeral range (32768-60999 by default): a
# port bound to 0 and released is one the kernel may hand any outgoing connection as its source
# port before the server binds it (seen: an operator's health port taken that way).
TEST_PORTS = range(23000, 32000)


def free_port() -> int:
    """A port no one listens on, on any address, outside the ephemeral range."""
    for _ in range(200):
        port = random.choice(TEST_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {TEST_PORTS}")


@dataclass
class OperatorProcess:
    """A running (or exited) operator."""

    process: subprocess.Popen[bytes]
    metrics_port: int
    health_port: int
    log_path: Path

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics, keyed by (name, sorted labels)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:  # loopback only
            text = response.read().decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return samples

    def requests(
        self, verbs: Sequence[str] = WRITE_VERBS, kinds: Sequence[str] | None = None
    ) -> float:
        """API requests the operator made with `verbs` (on `kinds`, default all)."""
        total = 0.0
        for (name, labels), value in self.metrics().items():
            if name != "dynamo_operator_api_requests_total":
                continue
            label = dict(labels)
            if label["verb"] in verbs and (kinds is None or label["kind"] in kinds):
                total += value
        return total

    def reconciles(self) -> float:
        """DynamoWorker reconciles finished so far."""
        key = ("dynamo_operator_reconcile_duration_seconds_count", (("kind", "DynamoWorker"),))
        return self.metrics().get(key, 0.0)

    def rss_bytes(self) -> int:
        return int(psutil.Process(self.process.pid).memory_info().rss)

    def health(self) -> tuple[int, str]:
        url = f"http://127.0.0.1:{self.health_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=15) as response:  # loopback only
                return response.status, response.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    async def eventually(
        self,
        what: str,
        probe: Callable[[], Awaitable[T]],
        within: float,
        until: Callable[[T], bool],
    ) -> T:
        """`support.cluster.eventually`, failing with `what` and the tail of this operator's
        log (what it did meanwhile is usually the explanation)."""
        try:
            return await eventually(probe, within, until, every=0.3)
        except AssertionError as err:
            raise AssertionError(f"{what}: {err}\noperator log:\n{self.log_tail(80)}") from None

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def exited(self) -> int | None:
        return self.process.poll()

    async def wait_exit(self, within: float) -> int:
        deadline = time.monotonic() + within
        while self.process.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"operator still running after {within}s:\n{self.log_tail()}")
            await asyncio.sleep(0.1)
        return int(self.process.returncode)

    async def wait_serving(self, within: float = 60) -> None:
        """Until /metrics answers (the operator finished its startup)."""
        deadline = time.monotonic() + within
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"operator exited early:\n{self.log_tail()}")
            try:
                self.metrics()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"operator not serving:\n{self.log_tail()}") from None
                await asyncio.sleep(0.2)

    def stop(self, timeout: float = 20) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_operator(
    cluster: Cluster,
    namespaces: Sequence[str],
    log_path: Path,
    *,
    resync_seconds: float = 3.0,
    extra_args: Sequence[str] = (),
    kubeconfig: Path | None = None,
) -> OperatorProcess:
    """Start `dynamo-operator run` for `namespaces` (against `kubeconfig`, by default the
    cluster's; e.g. a `support.api_proxy.ApiProxy`'s, to count its requests)."""
    metrics_port, health_port = free_port(), free_port()
    env = {**os.environ, "KUBECONFIG": str(kubeconfig or cluster.kubeconfig)}
    script = Path(sys.executable).parent / "dynamo-operator"
    args = [str(script), "run", "--worker-image", TEST_IMAGE]
    for namespace in namespaces:
        args += ["--namespace", namespace]
    args += [
        "--resync-seconds",
        str(resync_seconds),
        "--metrics-port",
        str(metrics_port),
        "--health-port",
        str(health_port),
        *extra_args,
    ]
    log = log_path.open("ab")
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    return OperatorProcess(process, metrics_port, health_port, log_path)


@contextmanager
def running_operator(
    cluster: Cluster,
    namespaces: Sequence[str],
    log_path: Path,
    *,
    resync_seconds: float = 3.0,
    extra_args: Sequence[str] = (),
) -> Iterator[OperatorProcess]:
    """An operator for the duration of the block (stopped with SIGTERM after)."""
    operator = start_operator(
        cluster, namespaces, log_path, resync_seconds=resync_seconds, extra_args=extra_args
    )
    try:
        yield operator
    finally:
        operator.stop()
