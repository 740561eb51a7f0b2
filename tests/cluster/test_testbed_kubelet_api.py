"""The process node serves the kubelet API: `kubectl logs` (follow, tail, since, timestamps,
previous), `exec` (exit codes, stdin, a TTY) and `port-forward`, through the real API
server, against one process-node pod that restarted once."""

from __future__ import annotations

import asyncio
import os
import pty
import re
import select
import subprocess
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio import client

from support.cluster import Cluster, eventually
from support.testbed_kubectl import kubectl, kubectl_argv

pytestmark = pytest.mark.cluster

# Run 1 prints to stdout and stderr and exits 3; run 2 (after the restart) prints, serves
# HTTP on the pod's loopback only (reachable through port-forward alone) and ticks.
SCRIPT = """
import http.server, os, pathlib, sys, threading, time
runs = pathlib.Path(os.environ["HOME"]) / "runs"
n = int(runs.read_text()) + 1 if runs.exists() else 1
runs.write_text(str(n))
print(f"run {n} stdout", flush=True)
print(f"run {n} stderr", file=sys.stderr, flush=True)
if n == 1:
    sys.exit(3)
server = http.server.ThreadingHTTPServer(("127.0.0.1", 8080), http.server.SimpleHTTPRequestHandler)
threading.Thread(target=server.serve_forever, daemon=True).start()
while True:
    time.sleep(0.3)
    print("tick", flush=True)
"""


@pytest_asyncio.fixture(scope="module")
async def pod(api: client.ApiClient, testbed: Cluster) -> AsyncIterator[tuple[str, str]]:
    """(namespace, name) of a Running pod on the process node whose container restarted once."""
    core = client.CoreV1Api(api)
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    await core.create_namespace({"metadata": {"name": namespace}})  # type: ignore[arg-type]
    await eventually(lambda: core.read_namespaced_service_account("default", namespace), 30)
    body: Any = {
        "metadata": {"name": "talker"},
        "spec": {
            "tolerations": [{"key": "dynamo.dev/process-node", "operator": "Exists"}],
            "nodeSelector": {"dynamo.dev/node-kind": "process"},
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {"name": "main", "image": "python:3.11", "command": ["python", "-c", SCRIPT]}
            ],
        },
    }
    await core.create_namespaced_pod(namespace, body)

    def restarted_and_running(p: client.V1Pod) -> bool:
        statuses = p.status.container_statuses or []
        return bool(statuses and statuses[0].restart_count == 1 and statuses[0].state.running)

    await eventually(
        lambda: core.read_namespaced_pod("talker", namespace), 60, restarted_and_running
    )
    yield namespace, "talker"
    await core.delete_namespace(namespace)


async def test_logs_current_previous_tail_since_and_timestamps(
    testbed: Cluster, pod: tuple[str, str]
) -> None:
    namespace, name = pod

    async def logs(*flags: str) -> str:
        result = await asyncio.to_thread(kubectl, testbed, "-n", namespace, "logs", name, *flags)
        assert result.returncode == 0, result.stderr
        return result.stdout

    current = await eventually(lambda: logs(), 10, until=lambda out: "tick" in out)
    assert {"run 2 stdout", "run 2 stderr"} <= set(current.splitlines())
    assert "run 1" not in current
    previous = await logs("--previous")
    assert sorted(previous.splitlines()) == ["run 1 stderr", "run 1 stdout"]
    assert len((await logs("--tail=2")).splitlines()) == 2
    stamped = (await logs("--timestamps", "--tail=1")).strip()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z tick", stamped), stamped
    # Ticks keep coming; the run's first lines are older than a second by now.
    await asyncio.sleep(1.5)
    recent = await logs("--since=1s")
    assert "tick" in recent
    assert "run 2" not in recent


async def test_logs_follow_streams_new_lines(testbed: Cluster, pod: tuple[str, str]) -> None:
    namespace, name = pod
    follow = await asyncio.create_subprocess_exec(
        *kubectl_argv(testbed, "-n", namespace, "logs", "-f", "--tail=0", name),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert follow.stdout is not None
        # --tail=0: nothing old; each line arrives as the container writes it.
        lines = [await asyncio.wait_for(follow.stdout.readline(), 15) for _ in range(2)]
        assert lines == [b"tick\n", b"tick\n"]
        assert follow.returncode is None  # still following
    finally:
        follow.kill()
        await follow.wait()


async def test_exec_exit_code_env_netns_and_stdin(testbed: Cluster, pod: tuple[str, str]) -> None:
    namespace, name = pod

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return kubectl(testbed, "-n", namespace, "exec", *args, stdin=stdin)

    failed = await asyncio.to_thread(run, name, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert failed.returncode == 7, failed.stderr
    assert failed.stdout == "out\n"
    assert "err" in failed.stderr
    # The container's environment and network namespace: its HOSTNAME, its pod IP on eth0.
    found = await asyncio.to_thread(
        run, name, "--", "sh", "-c", "echo $HOSTNAME; ip -4 -o addr show eth0"
    )
    assert found.returncode == 0, found.stderr
    hostname, address = found.stdout.splitlines()
    assert hostname == name
    assert " inet 198.18.1." in address
    echoed = await asyncio.to_thread(run, "-i", name, "--", "cat", stdin="through stdin\n")
    assert echoed.returncode == 0, echoed.stderr
    assert echoed.stdout == "through stdin\n"


async def test_exec_with_a_tty(testbed: Cluster, pod: tuple[str, str]) -> None:
    namespace, name = pod
    check = "import sys; print('tty', sys.stdin.isatty(), sys.stdout.isatty())"
    argv = kubectl_argv(testbed, "-n", namespace, "exec", "-it", name, "--")

    def run_in_terminal() -> tuple[int, str]:
        controller, terminal = pty.openpty()
        proc = subprocess.Popen(
            [*argv, "python", "-c", check], stdin=terminal, stdout=terminal, stderr=terminal
        )
        os.close(terminal)
        output = b""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(controller, 4096)
                except OSError:  # EIO: kubectl closed the terminal
                    break
                if not chunk:
                    break
                output += chunk
            elif proc.poll() is not None:
                break
        os.close(controller)
        return proc.wait(timeout=10), output.decode(errors="replace")

    code, output = await asyncio.to_thread(run_in_terminal)
    assert code == 0, output
    assert "tty True True" in output


async def test_port_forward_reaches_the_pods_loopback(
    testbed: Cluster, pod: tuple[str, str]
) -> None:
    namespace, name = pod
    forward = await asyncio.create_subprocess_exec(
        *kubectl_argv(testbed, "-n", namespace, "port-forward", f"pod/{name}", ":8080"),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert forward.stdout is not None
        first = (await asyncio.wait_for(forward.stdout.readline(), 20)).decode()
        match = re.search(r"127\.0\.0\.1:(\d+) -> 8080", first)
        assert match, first
        url = f"http://127.0.0.1:{match.group(1)}/"

        def get() -> int:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return int(resp.status)

        # The server listens on the pod's 127.0.0.1 only: nothing but the pod's own network
        # namespace reaches it.
        assert await asyncio.to_thread(get) == 200
        assert await asyncio.to_thread(get) == 200  # a second connection over the same session
    finally:
        forward.kill()
        await forward.wait()
