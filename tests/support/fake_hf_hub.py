"""A local HTTP server that imitates the Hugging Face Hub, for tests that cannot reach it.

The real Hub cannot be reached from tests, so this server speaks the subset of its protocol
that `huggingface_hub` uses to download a repository, and tests point the real client at it
with `HF_ENDPOINT`:

* `GET /api/models/{repo_id}/revision/{revision}`: repo info, JSON with `id`, `sha` (the
  40-hex commit) and `siblings` (`[{"rfilename": ...}]`).
* `HEAD` / `GET /{repo_id}/resolve/{revision}/{filename}`: a file, with the headers
  `huggingface_hub` reads: `X-Repo-Commit`, `ETag` (the blob name in the cache),
  `Content-Length`, and `X-Error-Code` on errors (`RepoNotFound`, `RevisionNotFound`,
  `EntryNotFound`, `GatedRepo`).

Private repositories demand `Authorization: Bearer <token>` like the Hub: no token gives
401 `RepoNotFound`, a wrong one 401 "Invalid credentials in Authorization header". It binds
127.0.0.1 on an OS-chosen port and records every request as `(method, path)`. `redirects`
sends a file's GET elsewhere with a 302, as the Hub does for LFS files.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    """One repository: its branches and the files of each commit."""

    refs: dict[str, str] = field(default_factory=dict)
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    # File names listed in the repo info but not served (to imitate hostile listings).
    listed_only: dict[str, list[str]] = field(default_factory=dict)
    token: str | None = None
    gated: bool = False


class FakeHub:
    """The Hub imitation; use `running_hub()` to start one."""

    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[tuple[str, str]] = []
        self.info_delay = 0.0
        # File name -> absolute URL: a GET of that file answers 302 there (as the Hub sends
        # LFS files to its CDN); HEAD still answers with the file's metadata.
        self.redirects: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        """The endpoint to put in `HF_ENDPOINT`."""
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_port}"

    def add_commit(
        self,
        repo_id: str,
        files: dict[str, bytes],
        revision: str = "main",
        *,
        listed_only: list[str] | None = None,
        token: str | None = None,
        gated: bool = False,
    ) -> str:
        """Add a commit holding `files`, point `revision` at it and return its sha."""
        digest = hashlib.sha1()
        for name in sorted(files):
            digest.update(name.encode() + b"\0" + files[name])
        digest.update(repr(sorted(listed_only or [])).encode())
        sha = digest.hexdigest()
        with self._lock:
            repo = self.repos.setdefault(repo_id, FakeRepo())
            repo.commits[sha] = dict(files)
            repo.listed_only[sha] = list(listed_only or [])
            repo.refs[revision] = sha
            repo.token = token
            repo.gated = gated
        return sha

    def count(self, method: str, fragment: str = "") -> int:
        """How many `method` requests had `fragment` in their path."""
        with self._lock:
            return sum(1 for m, path in self.requests if m == method and fragment in path)

    def start(self) -> None:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                hub._handle(self, body=True)

            def do_HEAD(self) -> None:
                hub._handle(self, body=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # -- request handling -------------------------------------------------------------

    def _handle(self, request: BaseHTTPRequestHandler, body: bool) -> None:
        path = urlsplit(request.path).path
        with self._lock:
            self.requests.append((request.command, path))
        if path.startswith("/api/models/"):
            self._repo_info(request, path[len("/api/models/") :], body)
            return
        if "/resolve/" in path:
            self._resolve(request, path, body)
            return
        self._reply(request, 404, b"", body, {"X-Error-Code": "RepoNotFound"})

    def _find(
        self, request: BaseHTTPRequestHandler, repo_id: str, revision: str, body: bool
    ) -> tuple[FakeRepo, str] | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._reply(request, 404, b"", body, {"X-Error-Code": "RepoNotFound"})
            return None
        auth = request.headers.get("Authorization")
        if repo.token is not None and auth != f"Bearer {repo.token}":
            headers = (
                {"X-Error-Message": "Invalid credentials in Authorization header"}
                if auth
                else {"X-Error-Code": "RepoNotFound"}
            )
            self._reply(request, 401, b"", body, headers)
            return None
        if repo.gated:
            self._reply(request, 403, b"", body, {"X-Error-Code": "GatedRepo"})
            return None
        sha = revision if revision in repo.commits else repo.refs.get(revision)
        if sha is None:
            self._reply(request, 404, b"", body, {"X-Error-Code": "RevisionNotFound"})
            return None
        return repo, sha

    def _repo_info(self, request: BaseHTTPRequestHandler, rest: str, body: bool) -> None:
        repo_id, _, revision = rest.partition("/revision/")
        if self.info_delay:
            # Imitates a Hub that does not answer in time (interrupted when the hub stops).
            self._stopping.wait(self.info_delay)
        found = self._find(request, repo_id, unquote(revision) or "main", body)
        if found is None:
            return
        repo, sha = found
        names = sorted(repo.commits[sha]) + repo.listed_only[sha]
        payload = {"id": repo_id, "sha": sha, "siblings": [{"rfilename": n} for n in names]}
        self._reply(
            request, 200, json.dumps(payload).encode(), body, {"Content-Type": "application/json"}
        )

    def _resolve(self, request: BaseHTTPRequestHandler, path: str, body: bool) -> None:
        repo_id, _, rest = path.lstrip("/").partition("/resolve/")
        revision, _, filename = rest.partition("/")
        found = self._find(request, repo_id, unquote(revision), body)
        if found is None:
            return
        repo, sha = found
        content = repo.commits[sha].get(unquote(filename))
        if content is None:
            headers = {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha}
            self._reply(request, 404, b"", body, headers)
            return
        headers = {
            "X-Repo-Commit": sha,
            "ETag": f'"{hashlib.sha256(content).hexdigest()}"',
            "Content-Type": "application/octet-stream",
        }
        target = self.redirects.get(unquote(filename))
        if target is not None and body:
            self._reply(request, 302, b"", body, {**headers, "Location": target})
            return
        self._reply(request, 200, content, body, headers)

    @staticmethod
    def _reply(
        request: BaseHTTPRequestHandler,
        status: int,
        content: bytes,
        body: bool,
        headers: dict[str, str],
    ) -> None:
        request.send_response(status)
        for name, value in headers.items():
            request.send_header(name, value)
        request.send_header("Content-Length", str(len(content)))
        request.end_headers()
        if body:
            request.wfile.write(content)


@contextmanager
def running_hub() -> Iterator[FakeHub]:
    """Start a `FakeHub` on 127.0.0.1 for the duration of the block."""
    hub = FakeHub()
    hub.start()
    try:
        yield hub
    finally:
        hub.stop()
