"""Upstream Dynamo's own processes (ai-dynamo 1.6.1 from PyPI) next to ours, on loopback.

`hack/oracle-venv` installs upstream into a venv of its own (`$DYNAMO_ORACLE_VENV`, default
~/.cache/dynamo-testbed/oracle-venv); tests that need it skip, naming that script, when it
is absent. `UpstreamFleet` shares one file-discovery folder (`DYN_FILE_KV`) between
upstream's frontend, upstream's sample worker and our `dynamo-worker` processes, all on
127.0.0.1 with their logs in the test's temp folder.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from support.worker_process import WorkerProcess

REPO = Path(__file__).resolve().parents[2]
ORACLE_VENV_ENV = "DYNAMO_ORACLE_VENV"
DEFAULT_ORACLE_VENV = Path.home() / ".cache" / "dynamo-testbed" / "oracle-venv"
SAMPLE_ENGINE = "dynamo.engines.sample:SampleEngine"
# What upstream's frontend (1.6.1) logs once it routes a model's requests through prefill.
PREFILL_ROUTER_ACTIVATED = "Prefill router target activated"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def oracle_venv() -> Path:
    """Where upstream's venv is expected."""
    return Path(os.environ.get(ORACLE_VENV_ENV) or DEFAULT_ORACLE_VENV)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for processes that cannot report theirs).

    Below 32768: upstream reads DYN_SYSTEM_PORT as a signed 16-bit number.
    """
    for _ in range(100):
        port = random.randrange(20000, 32768)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free TCP port in 20000-32767 on 127.0.0.1")


class UpstreamProcess:
    """One upstream process, its output in a log file."""

    def __init__(self, args: Sequence[str], env: Mapping[str, str], log: Path) -> None:
        self.log_path = log
        self._log = log.open("w")
        self.process = subprocess.Popen(
            list(args),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log(self, tail: int = 60) -> str:
        """The last `tail` lines it printed."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-tail:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        stop_processes([self])

    def close_log(self) -> None:
        """Closes the log file it writes to (once it has exited)."""
        self._log.close()


def stop_processes(processes: Iterable[UpstreamProcess]) -> None:
    """SIGTERM to every one at once, then SIGKILL to those still running 10 s later: a vLLM
    process takes about 8 s to exit, so stopping three one after the other took 25 s."""
    stopping = list(processes)
    for upstream in stopping:
        if upstream.process.poll() is None:
            upstream.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for upstream in stopping:
        try:
            upstream.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            upstream.process.kill()
            upstream.process.wait(10)
        upstream.close_log()


class UpstreamFleet:
    """Upstream's frontend, upstream's sample worker and our workers, sharing discovery."""

    def __init__(self, venv: Path, root: Path) -> None:
        self.python = venv / "bin" / "python"
        self.root = root
        self.kv = root / "kv"
        self.home = root / "home"
        self.kv.mkdir()
        self.home.mkdir()
        self.processes: list[UpstreamProcess] = []
        self.workers: list[WorkerProcess] = []
        self.frontend_url = ""
        self.frontend_log = root / "frontend.log"

    def upstream_env(self, **extra: str) -> dict[str, str]:
        """Loopback everywhere; HOME is scratch (the frontend caches model files there)."""
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),
            "DYN_FILE_KV": str(self.kv),
            "DYN_SYSTEM_HOST": "127.0.0.1",
            "DYN_TCP_RPC_HOST": "127.0.0.1",
            "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
            "DYN_EVENT_PLANE_HOST": "127.0.0.1",
            **extra,
        }

    async def start_frontend(self, *args: str) -> str:
        """Start `python -m dynamo.frontend` with file discovery; its base URL once it answers."""
        port = free_port()
        frontend = UpstreamProcess(
            [
                str(self.python),
                "-m",
                "dynamo.frontend",
                "--discovery-backend",
                "file",
                "--http-host",
                "127.0.0.1",
                "--http-port",
                str(port),
                *args,
            ],
            self.upstream_env(),
            self.frontend_log,
        )
        self.processes.append(frontend)
        self.frontend_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    async with session.get(self.frontend_url + "/v1/models") as response:
                        if response.status == 200:
                            return self.frontend_url
                except aiohttp.ClientError:
                    pass
                if frontend.process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"upstream's frontend did not start:\n{frontend.log()}")
                await asyncio.sleep(0.1)

    def start_upstream_worker(
        self, model: Path, *args: str, env: Mapping[str, str] | None = None
    ) -> tuple[UpstreamProcess, str]:
        """Upstream's sample worker (rotating token ids); it and its system server's URL."""
        port = free_port()
        worker = UpstreamProcess(
            [
                str(self.python),
                "-m",
                "dynamo.common.backend.sample_main",
                "--discovery-backend",
                "file",
                "--request-plane",
                "tcp",
                "--event-plane",
                "zmq",
                "--model-name",
                str(model),
                *args,
            ],
            self.upstream_env(DYN_SYSTEM_PORT=str(port), **(env or {})),
            self.root / f"upstream-worker-{len(self.processes)}.log",
        )
        self.processes.append(worker)
        return worker, f"http://127.0.0.1:{port}"

    def start_worker(self, *args: str, env: Mapping[str, str] | None = None) -> WorkerProcess:
        """Our `dynamo-worker`, published by file discovery with the TCP request plane."""
        worker = WorkerProcess(
            args,
            {
                "DYN_DISCOVERY_BACKEND": "file",
                "DYN_FILE_KV": str(self.kv),
                "DYN_REQUEST_PLANE": "tcp",
                "DYN_TCP_RPC_HOST": "127.0.0.1",
                # The test engines in tests/support import from here.
                "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")])
                ),
                **(env or {}),
            },
        )
        self.workers.append(worker)
        return worker

    async def wait_models(self, *names: str, within: float = 60) -> list[dict[str, Any]]:
        """Poll the frontend's /v1/models until every name is listed; the listing."""
        deadline = time.monotonic() + within
        async with aiohttp.ClientSession() as session:
            while True:
                async with session.get(self.frontend_url + "/v1/models") as response:
                    listing = (await response.json())["data"]
                if set(names) <= {model["id"] for model in listing}:
                    return list(listing)
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"frontend lists {[m['id'] for m in listing]}, never {list(names)}:\n"
                        + self.logs()
                    )
                await asyncio.sleep(0.1)

    async def wait_frontend_log(self, fragment: str, within: float = 30) -> None:
        """Wait until the frontend's log has a line containing `fragment` (ANSI colours
        removed)."""
        deadline = time.monotonic() + within
        while True:
            text = _ANSI.sub("", self.frontend_log.read_text(errors="replace"))
            if fragment in text:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"frontend never logged {fragment!r}:\n{self.logs()}")
            await asyncio.sleep(0.05)

    async def wait_prefill_router(self, within: float = 30) -> None:
        """Wait until the frontend routes through the prefill worker set. It lists the model
        once it has discovered both roles, and activates its prefill router only after that."""
        await self.wait_frontend_log(PREFILL_ROUTER_ACTIVATED, within)

    async def wait_kv_subscriptions(
        self, workers: int, within: float = 30, namespace: str | None = None
    ) -> None:
        """Until `workers` kv-events channels (of Dynamo namespace `namespace`, when named)
        are advertised in the file store and the frontend has connected to each (what
        KV-aware routing needs before it learns)."""
        channels = self.kv / "v1" / "event_channels"
        endpoints: list[str] = []
        deadline = time.monotonic() + within
        while len(endpoints) < workers:
            assert time.monotonic() < deadline, self.logs()
            records = [json.loads(path.read_text()) for path in channels.iterdir()]
            endpoints = [
                r["transport"]["config"]["endpoint"]
                for r in records
                if r["topic"] == "kv-events"
                and namespace in (None, r["scope"].get("endpoint", {}).get("namespace"))
            ]
            await asyncio.sleep(0.05)
        for endpoint in endpoints:
            await self.wait_frontend_log(
                f'stream connected endpoint="{endpoint}" topic="kv-events"'
            )

    def logs(self) -> str:
        """Every process's recent output, for failure messages."""
        parts = [f"--- {p.log_path.name}\n{p.log()}" for p in self.processes]
        parts += [f"--- our worker {w.command[-1]}\n{w.log()[-4000:]}" for w in self.workers]
        return "\n".join(parts)

    def close(self) -> None:
        """Stop our workers, then upstream's processes."""
        for worker in self.workers:
            worker.close()
        stop_processes(reversed(self.processes))


def upstream_python() -> Path:
    """The Python of upstream's venv; skips the calling test when there is none."""
    python = oracle_venv() / "bin" / "python"
    if not python.is_file():
        pytest.skip(
            f"upstream Dynamo's venv is not at {oracle_venv()}; create it with hack/oracle-venv "
            f"(or point ${ORACLE_VENV_ENV} at one with ai-dynamo 1.6.1)"
        )
    return python


def run_json_driver(
    python: str, driver: str, cases: Any, env: Mapping[str, str] | None = None
) -> Any:
    """Run `driver` (Python source) with `python`, the JSON of `cases` on its stdin; what it
    prints, read as JSON. The same driver run by our interpreter and by upstream's
    (`upstream_python()`) makes a differential test of a library seam."""
    ran = subprocess.run(
        [python, "-c", driver],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    return json.loads(ran.stdout)


@pytest.fixture
def upstream_fleet(tmp_path: Path) -> Iterator[UpstreamFleet]:
    """An `UpstreamFleet` in the test's temp folder; skipped without upstream's venv."""
    upstream_python()
    fleet = UpstreamFleet(oracle_venv(), tmp_path)
    yield fleet
    fleet.close()


async def post_json(url: str, body: Any) -> tuple[int, Any]:
    """A JSON request: the status and the decoded answer."""
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        return response.status, await response.json(content_type=None)


async def post_sse(
    url: str, body: Any, started: asyncio.Event | None = None
) -> tuple[int, list[Any]]:
    """A streamed OpenAI request: the status and the `data:` events (`[DONE]` kept as text);
    `started` is set once a 200's headers arrived (the response stream has begun)."""
    events: list[Any] = []
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        if started is not None and response.status == 200:
            started.set()
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data:"):
                data = line[len("data:") :].strip()
                events.append(data if data == "[DONE]" else json.loads(data))
        return response.status, events


async def streams_in_flight(
    url: str, body: Any, count: int
) -> list[asyncio.Task[tuple[int, list[Any]]]]:
    """`count` streamed requests (`post_sse`), returned once each has begun: the frontend
    answers 200 only after a worker took the request. A stream that ends before all have
    begun fails the wait, with what it answered, and so do 60 s without all of them begun."""
    begun = [asyncio.Event() for _ in range(count)]
    streams = [asyncio.create_task(post_sse(url, body, started)) for started in begun]
    all_begun = asyncio.create_task(
        asyncio.wait_for(asyncio.gather(*(started.wait() for started in begun)), 60)
    )
    await asyncio.wait([all_begun, *streams], return_when=asyncio.FIRST_COMPLETED)
    ended = [stream.result() for stream in streams if stream.done()]
    if not all_begun.done():
        all_begun.cancel()
    assert not ended, f"a stream ended before all {count} had begun: {ended}"
    await all_begun
    return streams


def assert_stream_completed(status: int, events: list[Any], tokens: int) -> None:
    """A `post_sse` answer ended whole: 200, `[DONE]` last, `tokens` tokens in its usage."""
    assert status == 200, events
    assert events[-1] == "[DONE]", events[-3:]
    usage = [e["usage"] for e in events[:-1] if e.get("usage")]
    assert usage, events[-3:]
    assert usage[-1]["completion_tokens"] == tokens, events[-3:]


async def listed_models(base: str) -> list[str]:
    """The model names an OpenAI server at `base` (ending in /v1) lists."""
    async with aiohttp.ClientSession() as session, session.get(base + "/models") as response:
        return [m["id"] for m in (await response.json(content_type=None)).get("data", [])]
