"""A loopback HTTP reverse proxy that counts the requests it forwards.

Put it in front of the moto S3 server (point `AWS_ENDPOINT` at the proxy) to count how
many object GETs a download made. Requests are forwarded unchanged (moto does not check
signatures, so the signed Host header may differ from the upstream address); response
bodies are buffered, so use it for small objects.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}


class CountingProxy:
    """Forwards to `upstream` (`http://host:port`) and records `(method, path)` per request."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.requests: list[tuple[str, str]] = []
        #: Set when the first object GET arrives.
        self.object_get_seen = threading.Event()
        #: While cleared, object GETs wait here before being forwarded (set = no holding).
        self.release_gets = threading.Event()
        self.release_gets.set()
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _forward(self) -> None:
                proxy._forward(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def count(self, method: str, fragment: str = "") -> int:
        """How many `method` requests had `fragment` in their path (query excluded)."""
        with self._lock:
            return sum(1 for m, p in self.requests if m == method and fragment in p)

    def object_gets(self) -> int:
        """GETs of objects (listings carry a query string such as `?list-type=2`)."""
        with self._lock:
            return sum(1 for m, p in self.requests if m == "GET" and "?" not in p)

    def _forward(self, request: BaseHTTPRequestHandler) -> None:
        with self._lock:
            self.requests.append((request.command, request.path))
        if request.command == "GET" and "?" not in request.path:
            self.object_get_seen.set()
            self.release_gets.wait(timeout=60)
        length = int(request.headers.get("Content-Length") or 0)
        payload = request.rfile.read(length) if length else None
        upstream = http.client.HTTPConnection(*self._upstream, timeout=60)
        try:
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
            if payload is not None:
                headers["Content-Length"] = str(len(payload))
            upstream.request(request.command, request.path, body=payload, headers=headers)
            response = upstream.getresponse()
            body = response.read()
        finally:
            upstream.close()
        request.send_response(response.status)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP:
                request.send_header(name, value)
        # A HEAD answer has no body but announces the object's length.
        length_header = response.getheader("Content-Length") if request.command == "HEAD" else None
        request.send_header("Content-Length", length_header or str(len(body)))
        request.end_headers()
        if request.command != "HEAD":
            request.wfile.write(body)

    def start(self) -> None:
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@contextmanager
def counting_proxy(upstream: str) -> Iterator[CountingProxy]:
    """Run a `CountingProxy` in front of `upstream` for the duration of the block."""
    proxy = CountingProxy(upstream)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
