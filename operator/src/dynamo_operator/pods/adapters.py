"""`/v1/loras` on worker pods' system servers: list, load and unload, bounded and timed.

The same pattern as the model-taint pushes (`pods.taints`): one shared aiohttp session
built at startup, a semaphore bounding concurrent requests, a timeout on every request, and
errors turned into values rather than exceptions. Loads wait for the worker's download and
get a long timeout of their own, and a bound of their own per pod (`loads_per_pod`), so slow
downloads never hold up the quick requests (lists and unloads) that verification and deletion
depend on, many adapters load on many pods at once, and no pod is sent more downloads than it
fetches well side by side: each download already fetches its files in parallel, and on the
test bed 20 adapters on 4 pods arrive sooner one at a time per pod than 2 or 4 (see
tests/bench/bench_lora_adapter.py). A load still running after `load_slot_seconds` gives its
slot up, so a stuck download holds the pod's next load back that long at most.

Request bodies carry the adapter name and source (`uri`, optional `sha256`) and nothing
else: workers download with the credentials in their own environment. Answers of
`GET /v1/loras` are shared: concurrent lists of one pod make one request, an answer is
reused for `cache_seconds`, and a load or unload on a pod drops its cached answer so the
next list sees the change.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from dynamo_operator.pods import routes

# The worker's machine-readable `reason` values (dynamo.common.lora.errors, lora_host) and
# the CamelCase reasons status shows for them.
WORKER_REASONS: dict[str, str] = {
    "digest mismatch": "DigestMismatch",
    "bad digest": "InvalidDigest",
    "not found": "SourceNotFound",
    "auth": "AuthFailed",
    "bad uri": "InvalidSource",
    "invalid adapter": "InvalidAdapter",
    "unsafe source": "UnsafeSource",
    "timeout": "DownloadTimeout",
    "offline": "HubOffline",
    "download failed": "DownloadFailed",
    "capacity": "CapacityExceeded",
    "unavailable": "LoRADisabled",
    "engine": "EngineError",
    "bad request": "BadRequest",
    "not loaded": "NotLoaded",
}
CAPACITY_EXCEEDED = "CapacityExceeded"
WORKER_UNREACHABLE = "WorkerUnreachable"
LORA_DISABLED = "LoRADisabled"
# The worker's admin check refused the operator's token (missing, wrong audience, or no
# `update` on dynamoworkers/admin): the message says which.
OPERATOR_NOT_ADMITTED = "OperatorNotAdmitted"


@dataclass(frozen=True)
class Listing:
    """A pod's answer to `GET /v1/loras`: adapter name -> id, or why there is none;
    `sources`: name -> (uri, sha256) of the load it serves, for workers that say (ours do,
    upstream's do not)."""

    loras: Mapping[str, int] | None = None
    reason: str = ""
    message: str = ""
    sources: Mapping[str, tuple[str, str | None]] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return len(self.loras) if self.loras is not None else 0


@dataclass(frozen=True)
class OpResult:
    """The answer to a load or unload (`reason` is CamelCase; empty when `ok`)."""

    ok: bool
    reason: str = ""
    message: str = ""
    lora_id: int | None = None


def reason_for(http_status: int, worker_reason: str | None, message: str) -> str:
    """The CamelCase reason for a failed `/v1/loras` request."""
    if worker_reason and worker_reason in WORKER_REASONS:
        return WORKER_REASONS[worker_reason]
    if message.startswith("LoRA capacity exceeded"):
        return CAPACITY_EXCEEDED
    if http_status == 404:
        return LORA_DISABLED
    if http_status in (401, 403):
        return OPERATOR_NOT_ADMITTED
    return "LoadFailed"


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class LoraClient:
    """Requests to the `/v1/loras` routes of worker pods, addressed by pod IP."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        concurrency: int = 16,
        loads_per_pod: int = 1,
        load_slot_seconds: float = 30.0,
        request_timeout_seconds: float = 5.0,
        load_timeout_seconds: float = 900.0,
        cache_seconds: float = 1.0,
        url_for: Callable[[str, str], str] = routes.system_url,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._session = session
        self._loads_per_pod = loads_per_pod
        self._load_slot_seconds = load_slot_seconds
        # Per pod IP: its load bound and how many loads hold or wait for it (dropped at 0).
        self._loads: dict[str, tuple[asyncio.Semaphore, int]] = {}
        self._quick = asyncio.Semaphore(concurrency)
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_seconds)
        self._request_timeout = request_timeout_seconds
        self._load_timeout = aiohttp.ClientTimeout(total=load_timeout_seconds)
        self._load_timeout_seconds = load_timeout_seconds
        self._cache_seconds = cache_seconds
        self._url_for = url_for
        self._clock = clock
        self._cache: dict[str, tuple[float, Listing]] = {}
        self._listing: dict[str, asyncio.Future[Listing]] = {}
        # Bumped by each invalidation: an answer to a list sent before it is not cached.
        self._epoch: dict[str, int] = {}
        self.requests = 0

    def invalidate(self, ip: str) -> None:
        """Forget the cached list of the pod at `ip`."""
        self._cache.pop(ip, None)
        self._epoch[ip] = self._epoch.get(ip, 0) + 1

    async def list(self, ip: str) -> Listing:
        """`GET /v1/loras`: the adapters the pod serves, or why that is unknown."""
        cached = self._cache.get(ip)
        if cached is not None and self._clock() - cached[0] < self._cache_seconds:
            return cached[1]
        shared = self._listing.get(ip)
        if shared is not None:
            return await asyncio.shield(shared)
        future: asyncio.Future[Listing] = asyncio.get_running_loop().create_future()
        self._listing[ip] = future
        try:
            started, epoch = self._clock(), self._epoch.get(ip, 0)
            listing = await self._list(ip)
            # An invalidation while the request was out leaves this answer uncached.
            if self._epoch.get(ip, 0) == epoch:
                self._cache[ip] = (started, listing)
            future.set_result(listing)
            return listing
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: sharers may be gone
            raise
        finally:
            del self._listing[ip]

    async def _list(self, ip: str) -> Listing:
        async with self._quick:
            status, body, error = await self._request(
                "GET", ip, routes.LORAS_PATH, None, self._timeout
            )
        if error:
            return Listing(reason=WORKER_UNREACHABLE, message=error)
        if status == 404:
            return Listing(reason=LORA_DISABLED, message="the pod serves no /v1/loras route")
        loras = body.get("loras") if isinstance(body, dict) else None
        if status != 200 or not isinstance(loras, dict):
            message = body.get("message") if isinstance(body, dict) else None
            return Listing(reason="ListFailed", message=f"HTTP {status}: {message or body}")
        clean = {str(k): int(v) for k, v in loras.items() if isinstance(v, int)}
        return Listing(loras=clean, sources=_sources(body.get("sources")))

    async def load(self, ip: str, name: str, uri: str, sha256: str | None) -> OpResult:
        """`POST /v1/loras`: load (or hot-swap to) `uri` under `name`; idempotent."""
        source: dict[str, str] = {"uri": uri}
        if sha256 is not None:
            source["sha256"] = sha256
        body = {"lora_name": name, "source": source}
        try:
            async with self._pod_load_slot(ip):
                status, answer, error = await self._request(
                    "POST", ip, routes.LORAS_PATH, body, self._load_timeout
                )
        finally:
            self.invalidate(ip)
        if error == "timeout":
            return OpResult(
                ok=False,
                reason="RequestTimeout",
                message=f"no answer within {self._load_timeout_seconds:g}s",
            )
        if error:
            return OpResult(ok=False, reason=WORKER_UNREACHABLE, message=error)
        return _result(status, answer)

    @contextlib.asynccontextmanager
    async def _pod_load_slot(self, ip: str) -> AsyncIterator[None]:
        """Hold one of the pod's `loads_per_pod` load slots, for `load_slot_seconds` at most."""
        bound, users = self._loads.get(ip) or (asyncio.Semaphore(self._loads_per_pod), 0)
        self._loads[ip] = (bound, users + 1)
        held, timer = False, None

        def give_up() -> None:
            nonlocal held
            if held:
                held = False
                bound.release()

        try:
            await bound.acquire()
            held = True
            timer = asyncio.get_running_loop().call_later(self._load_slot_seconds, give_up)
            yield
        finally:
            if timer is not None:
                timer.cancel()
            give_up()
            bound, users = self._loads[ip]
            if users == 1:
                del self._loads[ip]
            else:
                self._loads[ip] = (bound, users - 1)

    async def unload(self, ip: str, name: str, timeout_seconds: float | None = None) -> OpResult:
        """`DELETE /v1/loras/{name}`; reason NotLoaded when the pod does not have it."""
        seconds = self._request_timeout if timeout_seconds is None else timeout_seconds
        path = f"{routes.LORAS_PATH}/{urllib.parse.quote(name, safe='/:')}"
        try:
            async with self._quick:
                status, answer, error = await self._request(
                    "DELETE", ip, path, None, aiohttp.ClientTimeout(total=max(seconds, 0.1))
                )
        finally:
            self.invalidate(ip)
        if error == "timeout":
            return OpResult(
                ok=False, reason="RequestTimeout", message=f"no answer within {seconds:g}s"
            )
        if error:
            return OpResult(ok=False, reason=WORKER_UNREACHABLE, message=error)
        return _result(status, answer)

    async def _request(
        self, method: str, ip: str, path: str, body: Any, limit: aiohttp.ClientTimeout
    ) -> tuple[int, Any, str]:
        """(HTTP status, JSON body, "" ) or (0, None, error); "timeout" when none came."""
        self.requests += 1
        try:
            async with self._session.request(
                method, self._url_for(ip, path), json=body, timeout=limit
            ) as response:
                text = await response.text()
        except TimeoutError:
            return 0, None, "timeout"
        except aiohttp.ClientError as exc:
            return 0, None, _error_text(exc)
        try:
            return response.status, json.loads(text) if text else None, ""
        except ValueError:
            return response.status, {"message": text[:200]}, ""


def _result(status: int, answer: Any) -> OpResult:
    body = answer if isinstance(answer, dict) else {}
    failed = status != 200 or str(body.get("status", "")).lower() == "error"
    message = str(body.get("message") or "")
    if not failed:
        lora_id = body.get("lora_id")
        return OpResult(
            ok=True, message=message, lora_id=lora_id if isinstance(lora_id, int) else None
        )
    worker_reason = body.get("reason")
    reason = reason_for(status, worker_reason if isinstance(worker_reason, str) else None, message)
    return OpResult(ok=False, reason=reason, message=message or f"HTTP {status}")


def _sources(listed: Any) -> dict[str, tuple[str, str | None]]:
    """`{name: {"uri": ..., "sha256": ...}}` from a list answer; what is malformed is left out."""
    if not isinstance(listed, dict):
        return {}
    sources: dict[str, tuple[str, str | None]] = {}
    for name, source in listed.items():
        uri = source.get("uri") if isinstance(source, dict) else None
        sha256 = source.get("sha256") if isinstance(source, dict) else None
        if isinstance(uri, str):
            sources[str(name)] = (uri, sha256 if isinstance(sha256, str) else None)
    return sources
