"""A loopback front for the test bed's API server that counts every request it forwards.

An operator pointed at `ApiProxy.kubeconfig()` speaks plain HTTP to 127.0.0.1; the proxy
opens one TLS connection upstream per client connection, as the kubeconfig's admin user
(client certificate), and copies bytes both ways. It parses only the client's side (request
line, headers, body length) to record `(method, path)` of each request, so whatever the
operator sends counts, kopf's own patches and Events included, and watch streams flow through
untouched. One proxy per operator process attributes each write to its sender.

Faults for the fault-injection suite:
- `kill_before_write(k, kill)`: when a write arrives after `k` writes (the Lease's aside)
  reached the server, call `kill` (SIGKILL the operator) and drop that write and every later
  request: the operator dies right after its k-th write, counted where the server sees it;
- `fail_next(n, status)`: answer the next `n` requests other than watches with `status`
  (429 with Retry-After, or a 5xx) without forwarding them;
- `silence_watches()`: the watch streams open now stop forwarding anything from the server,
  for good, while their TCP connections stay up (a silent watch); watches opened later work;
- `expire_watches(n)`: every open connection is closed (so the operator watches again from
  the resourceVersion it saw last), and the next `n` watches get what the API server sends for
  a resourceVersion compacted away: an ERROR event with a 410 Gone Status, then the end;

It runs on its own thread and event loop, so a test that blocks its own loop (waiting for a
process) does not stall the operators' traffic.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import yaml

READ_METHODS = ("GET", "HEAD")
REASONS = {429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable"}


@dataclass(eq=False)
class _Link:
    """One client connection: whether its last request was a watch, and whether the server's
    bytes still flow to it."""

    watch: bool = False
    flowing: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.flowing.set()


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # without the query
    at: float  # time.monotonic() when it arrived
    watch: bool = False

    @property
    def is_write(self) -> bool:
        return self.method not in READ_METHODS

    @property
    def on_lease(self) -> bool:
        return "/leases" in self.path


def _tls_context(kubeconfig: Path, scratch: Path) -> tuple[ssl.SSLContext, str, int]:
    config = yaml.safe_load(kubeconfig.read_text())
    cluster = config["clusters"][0]["cluster"]
    user = config["users"][0]["user"]
    context = ssl.create_default_context(
        cadata=base64.b64decode(cluster["certificate-authority-data"]).decode()
    )
    cert, key = scratch / "client.crt", scratch / "client.key"
    cert.write_bytes(base64.b64decode(user["client-certificate-data"]))
    key.write_bytes(base64.b64decode(user["client-key-data"]))
    key.chmod(0o600)
    context.load_cert_chain(cert, key)
    server = urlsplit(cluster["server"])
    return context, server.hostname or "", server.port or 443


class ApiProxy:
    """Forwards loopback HTTP to the API server of `kubeconfig` and records each request."""

    def __init__(self, kubeconfig: Path) -> None:
        self._scratch = tempfile.TemporaryDirectory(prefix="api-proxy-")
        self._tls, self._host, self._port = _tls_context(kubeconfig, Path(self._scratch.name))
        self._lock = threading.Lock()
        self._requests: list[Request] = []
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._kill: tuple[int, Callable[[], None]] | None = None
        self._killed = False
        self._failures: list[int] = []
        self._expiring = 0
        self.injected = 0
        self.port = 0

    # -- what passed ---------------------------------------------------------------------

    def requests(self, since: float = 0.0) -> list[Request]:
        with self._lock:
            return [r for r in self._requests if r.at >= since]

    def writes(self, since: float = 0.0, *, leases: bool = False) -> list[Request]:
        """Write requests since `since`, without those on the Lease unless `leases`."""
        return [r for r in self.requests(since) if r.is_write and (leases or not r.on_lease)]

    # -- faults --------------------------------------------------------------------------

    def kill_before_write(self, k: int, kill: Callable[[], None]) -> None:
        with self._lock:
            self._kill, self._killed = (k, kill), False

    @property
    def killed(self) -> bool:
        with self._lock:
            return self._killed

    def fail_next(self, count: int, status: int) -> None:
        with self._lock:
            self._failures.extend([status] * count)

    def expire_watches(self, count: int) -> None:
        async def cut() -> None:
            with self._lock:
                self._expiring = count
            for writer in list(self._writers):
                writer.close()

        asyncio.run_coroutine_threadsafe(cut(), self._loop).result(10)

    @property
    def expiring(self) -> int:
        with self._lock:
            return self._expiring

    def silence_watches(self) -> int:
        """Silence the watch streams open now; how many there were."""

        def silence() -> int:
            watches = [link for link in self._links if link.watch]
            for link in watches:
                link.flowing.clear()
            return len(watches)

        async def run() -> int:
            return silence()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    # -- running -------------------------------------------------------------------------

    def kubeconfig(self, path: Path) -> Path:
        """Write a kubeconfig for this proxy (no credentials: the proxy adds them) at `path`."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "proxy", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "proxy", "user": {}}],
            "contexts": [{"name": "proxy", "context": {"cluster": "proxy", "user": "proxy"}}],
            "current-context": "proxy",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def start(self) -> None:
        started = threading.Event()

        async def serve() -> None:
            self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]
            started.set()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(serve())
            self._loop.run_forever()

        threading.Thread(target=run, name="api-proxy", daemon=True).start()
        if not started.wait(10):
            raise RuntimeError("the API proxy did not start")

    def stop(self) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()
            for writer in list(self._writers):
                writer.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._scratch.cleanup()

    async def _connection(
        self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> None:
        self._writers.add(client_w)
        try:
            upstream_r, upstream_w = await asyncio.open_connection(
                self._host, self._port, ssl=self._tls, server_hostname=self._host
            )
        except OSError:
            client_w.close()
            self._writers.discard(client_w)
            return
        self._writers.add(upstream_w)
        link = _Link()
        self._links.add(link)
        tasks = [
            asyncio.create_task(self._requests_upstream(client_r, upstream_w, client_w, link)),
            asyncio.create_task(self._answers_back(upstream_r, client_w, link)),
        ]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        self._links.discard(link)
        for writer in (client_w, upstream_w):
            writer.close()
            self._writers.discard(writer)

    async def _requests_upstream(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        client: asyncio.StreamWriter,
        link: _Link,
    ) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if sep:
                    headers[name.strip().lower()] = value.strip()
            body = b""
            if "content-length" in headers:
                body = await reader.readexactly(int(headers["content-length"]))
            elif headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    size_line = await reader.readuntil(b"\r\n")
                    size = int(size_line.split(b";")[0], 16)
                    body += size_line + await reader.readexactly(size + 2)
                    if size == 0:
                        break
            link.watch = "watch=" in target
            request = Request(method, target.split("?")[0], time.monotonic(), link.watch)
            verdict = self._judge(request)
            if verdict == "drop":
                return
            if verdict == "expire":
                client.write(_GONE_WATCH)
                await client.drain()
                return
            if isinstance(verdict, int):
                client.write(_status_response(verdict))
                await client.drain()
                continue
            writer.write(head + body)
            await writer.drain()

    def _judge(self, request: Request) -> str | int | None:
        """What to do with a request: None (forward), "drop" (the operator is being killed),
        or a status to answer with."""
        with self._lock:
            if self._killed:
                return "drop"
            if self._expiring and request.watch:
                self._expiring -= 1
                return "expire"
            if self._failures and not request.watch:
                self.injected += 1
                return self._failures.pop(0)
            if self._kill is not None and request.is_write and not request.on_lease:
                k, kill = self._kill
                if sum(1 for r in self._requests if r.is_write and not r.on_lease) >= k:
                    self._killed = True
                    kill()
                    return "drop"
            self._requests.append(request)
            return None

    async def _answers_back(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link
    ) -> None:
        while True:
            data = await reader.read(65536)
            if not data:
                return
            await link.flowing.wait()
            writer.write(data)
            await writer.drain()


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


_GONE_WATCH = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    + _chunk(
        b'{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","metadata":{},'
        b'"status":"Failure","message":"too old resource version (injected by the test proxy)",'
        b'"reason":"Expired","code":410}}\n'
    )
    + b"0\r\n\r\n"
)


def _status_response(status: int) -> bytes:
    reason = REASONS.get(status, "InternalError")
    body = (
        '{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",'
        f'"message":"injected by the test proxy","reason":"{reason}","code":{status}}}'
    ).encode()
    retry = "Retry-After: 1\r\n" if status == 429 else ""
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n{retry}"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


@contextmanager
def api_proxy(kubeconfig: Path) -> Iterator[ApiProxy]:
    """An `ApiProxy` for the duration of the block."""
    proxy = ApiProxy(kubeconfig)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
