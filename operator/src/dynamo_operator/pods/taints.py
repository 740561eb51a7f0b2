"""Pushing spec.modelTaints to ready worker pods (`POST /engine/update/model_taints`).

Level-based: on each reconcile, every ready pod whose published taints (its
DynamoWorkerMetadata's caller-set taints) differ from spec.modelTaints gets a push, in the
background so a slow or unreachable pod never holds up a reconcile. Pushes share a bounded
concurrency, each request has a timeout, and failed requests are retried with exponential
backoff; a pod whose push keeps failing is retried on later reconciles with a growing delay,
and reported in the worker's Degraded condition meanwhile.

After a successful push, the worker rewrites its DynamoWorkerMetadata; until that change is
seen the pod is not pushed again (for `CONFIRM_WAIT_SECONDS`, after which the push repeats in
case the record was lost). `on_done(namespace, worker)` is called when a push finishes, so the
handlers can refresh the worker's status.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from dynamo_operator.api.metadata import DynamoWorkerMetadata
from dynamo_operator.metrics import OperatorMetrics
from dynamo_operator.pods import routes

logger = logging.getLogger(__name__)

CONFIRM_WAIT_SECONDS = 30.0
MAX_RETRY_DELAY_SECONDS = 300.0


@dataclass
class _Attempt:
    taints: tuple[str, ...]
    in_flight: bool = True
    ok: bool = False
    error: str = ""
    finished_at: float = 0.0
    failures: int = 0


class WorkerPod(Protocol):
    """What a push needs to know of a worker pod (the reconcile layer's pod summary)."""

    @property
    def name(self) -> str: ...
    @property
    def uid(self) -> str: ...
    @property
    def ip(self) -> str | None: ...
    @property
    def ready(self) -> bool: ...
    @property
    def terminating(self) -> bool: ...


def pod_url(pod: WorkerPod) -> str:
    """The model-taints route of a pod's system server."""
    return routes.system_url(pod.ip or "", routes.MODEL_TAINTS_PATH)


class TaintPusher:
    """Keeps ready pods' model taints equal to their DynamoWorker's spec.modelTaints."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        on_done: Callable[[str, str], None] = lambda namespace, worker: None,
        url_for: Callable[[WorkerPod], str] = pod_url,
        concurrency: int = 16,
        timeout_seconds: float = 5.0,
        attempts: int = 3,
        backoff_seconds: float = 0.5,
        metrics: OperatorMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._session = session
        self._on_done = on_done
        self._url_for = url_for
        self._limit = asyncio.Semaphore(concurrency)
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._attempts = attempts
        self._backoff = backoff_seconds
        self._metrics = metrics
        self._clock = clock
        # Per worker (namespace, name): per pod uid, the last push.
        self._state: dict[tuple[str, str], dict[str, _Attempt]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def sync(
        self,
        namespace: str,
        worker: str,
        desired: Sequence[str],
        pods: Sequence[WorkerPod],
        metadata: Mapping[str, DynamoWorkerMetadata],
    ) -> dict[str, str]:
        """Start the pushes `pods` need; return the pods whose last push failed (name ->
        error). Call it on every reconcile of the worker."""
        wanted = tuple(sorted(set(desired)))
        failures: dict[str, str] = {}
        now = self._clock()
        state = self._state.setdefault((namespace, worker), {})
        for gone in set(state) - {pod.uid for pod in pods}:
            del state[gone]
        for pod in pods:
            if not pod.ready or pod.terminating or not pod.ip:
                continue
            record = metadata.get(pod.name)
            config = record.runtime_config if record is not None else None
            published = tuple(config.caller_taints) if config is not None else None
            if published == wanted or (published is None and not wanted):
                state.pop(pod.uid, None)
                continue
            attempt = state.get(pod.uid)
            if attempt is not None and attempt.taints == wanted:
                if attempt.in_flight:
                    continue
                if attempt.ok and now - attempt.finished_at < CONFIRM_WAIT_SECONDS:
                    continue
                if not attempt.ok:
                    failures[pod.name] = attempt.error
                    if now - attempt.finished_at < self._retry_delay(attempt.failures):
                        continue
            state[pod.uid] = self._start(namespace, worker, pod, wanted, attempt)
        if not state:
            del self._state[(namespace, worker)]
        return failures

    def forget(self, namespace: str, worker: str) -> None:
        """Drop what is remembered about a worker that is gone."""
        self._state.pop((namespace, worker), None)

    def _retry_delay(self, failures: int) -> float:
        return float(min(MAX_RETRY_DELAY_SECONDS, self._backoff * 2 ** (failures + 2)))

    def _start(
        self,
        namespace: str,
        worker: str,
        pod: WorkerPod,
        wanted: tuple[str, ...],
        previous: _Attempt | None,
    ) -> _Attempt:
        failures = previous.failures if previous is not None and previous.taints == wanted else 0
        attempt = _Attempt(taints=wanted, failures=failures)
        task = asyncio.create_task(self._push(namespace, worker, pod, attempt))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return attempt

    async def _push(self, namespace: str, worker: str, pod: WorkerPod, attempt: _Attempt) -> None:
        error = ""
        try:
            for number in range(self._attempts):
                if number:
                    await asyncio.sleep(self._backoff * 2 ** (number - 1))
                error = await self._post(pod, attempt.taints)
                if not error:
                    break
        finally:
            attempt.in_flight = False
            attempt.ok = not error
            attempt.error = error
            attempt.finished_at = self._clock()
            if error:
                attempt.failures += 1
                logger.warning("Model taints not applied to pod %s: %s", pod.name, error)
            else:
                logger.info("Applied model taints %s to pod %s", list(attempt.taints), pod.name)
            if self._metrics is not None:
                self._metrics.taint_pushes.labels(result="error" if error else "ok").inc()
            self._on_done(namespace, worker)

    async def _post(self, pod: WorkerPod, taints: tuple[str, ...]) -> str:
        """One POST; the error text, or "" on success."""
        async with self._limit:
            try:
                async with self._session.post(
                    self._url_for(pod), json={"taints": list(taints)}, timeout=self._timeout
                ) as response:
                    text = await response.text()
                    if response.status != 200:
                        return f"HTTP {response.status}: {text[:200]}"
                    body = await response.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if not isinstance(body, dict) or body.get("status") != "ok":
            message = body.get("message") if isinstance(body, dict) else body
            return f"the worker answered: {message}"
        return ""

    async def wait_idle(self) -> None:
        """Until the pushes started so far have finished."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Cancel pushes still running."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
