"""The operator's configuration and the services built from it at startup (kopf's memo).

`OperatorConfig` comes from the command line. `OperatorContext` is the memo kopf hands every
handler: it starts empty, `start()` builds the API client, the reconcilers (DynamoWorker and
LoRAAdapter), the taint pusher and the metrics server once the event loop runs, and `stop()`
closes them. Its `__copy__` returns itself, so the per-object memos kopf makes are all this
one shared context.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self

import aiohttp
from aiohttp import web
from kubernetes_asyncio import client

from dynamo_operator.k8s.client import Cluster, connect
from dynamo_operator.metrics import OperatorMetrics
from dynamo_operator.reconcile.crds import install_crds
from dynamo_operator.reconcile.lora import Backoff
from dynamo_operator.reconcile.lora_http import LoraClient
from dynamo_operator.reconcile.lora_reconciler import LoraReconciler
from dynamo_operator.reconcile.settings import ReconcileSettings
from dynamo_operator.reconcile.taints import TaintPusher
from dynamo_operator.reconcile.worker import WorkerReconciler

logger = logging.getLogger(__name__)

WorkerKey = tuple[str, str]  # (namespace, DynamoWorker name)
AdapterKey = tuple[str, str]  # (namespace, LoRAAdapter name)


@dataclass(frozen=True)
class OperatorConfig:
    """How the operator runs (from `dynamo-operator run`'s options).

    `resync_seconds`: every DynamoWorker is reconciled at least this often, which repairs
    drift no watch reports (a child deleted out of band, an edited Role). `debounce_seconds`:
    a burst of child events (pods becoming ready) leads to one reconcile after this pause.
    `crash_after_writes`: fault injection for tests (exit after that many writes).
    `lora_*`: requests to the pods' `/v1/loras` (bounded concurrency; timeouts for lists
    and unloads, and for loads, which wait for the download); the longest a LoRAAdapter's
    deletion waits for its unloads; the first retry delay after a failed load (doubling up
    to 5 minutes).
    """

    namespaces: tuple[str, ...] = ()
    all_namespaces: bool = False
    worker_image: str | None = None
    worker_image_pull_secrets: tuple[str, ...] = ()
    frontend_image: str | None = None
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 8080
    health_host: str = "0.0.0.0"
    health_port: int = 8081
    resync_seconds: float = 30.0
    debounce_seconds: float = 0.2
    install_crds: bool = True
    request_timeout_seconds: float = 30.0
    taint_concurrency: int = 16
    taint_timeout_seconds: float = 5.0
    crash_after_writes: int | None = None
    lora_concurrency: int = 16
    lora_request_timeout_seconds: float = 5.0
    lora_load_timeout_seconds: float = 900.0
    lora_unload_bound_seconds: float = 10.0
    lora_backoff_seconds: float = 2.0

    def __post_init__(self) -> None:
        if self.all_namespaces == bool(self.namespaces):
            raise ValueError("give --namespace (one or more) or --all-namespaces, not both")
        if self.resync_seconds <= 0:
            raise ValueError("--resync-seconds must be positive")


@dataclass
class Services:
    """What `OperatorContext.start()` builds."""

    api: client.ApiClient
    cluster: Cluster
    reconciler: WorkerReconciler
    http: aiohttp.ClientSession
    taints: TaintPusher
    lora: LoraReconciler
    metrics_runner: web.AppRunner | None


@dataclass
class OperatorContext:
    """Shared state of one operator process (kopf's memo)."""

    config: OperatorConfig
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    started_at: float = field(default_factory=time.monotonic)
    _services: Services | None = None
    _triggers: dict[WorkerKey, asyncio.Event] = field(default_factory=dict)
    _locks: dict[WorkerKey, asyncio.Lock] = field(default_factory=dict)
    _lora_triggers: dict[AdapterKey, asyncio.Event] = field(default_factory=dict)

    def __copy__(self) -> Self:
        return self

    @property
    def services(self) -> Services:
        if self._services is None:
            raise RuntimeError("the operator context is not started")
        return self._services

    async def start(self, on_taints_done: Callable[[str, str], None] | None = None) -> None:
        """Build the clients and servers; install the CRDs when configured to."""
        api = await connect()
        cluster = Cluster(
            api,
            self.metrics,
            request_timeout_seconds=self.config.request_timeout_seconds,
            crash_after_writes=self.config.crash_after_writes,
        )
        if self.config.install_crds:
            written = await install_crds(cluster)
            if written:
                logger.info("Installed CRDs: %s", ", ".join(written))
        http = aiohttp.ClientSession()
        taints = TaintPusher(
            http,
            on_done=on_taints_done or self.trigger,
            concurrency=self.config.taint_concurrency,
            timeout_seconds=self.config.taint_timeout_seconds,
            metrics=self.metrics,
        )
        reconciler = WorkerReconciler(
            cluster,
            ReconcileSettings(
                worker_image=self.config.worker_image,
                worker_image_pull_secrets=self.config.worker_image_pull_secrets,
                frontend_image=self.config.frontend_image,
            ),
            taints,
            reporting_instance=socket.gethostname(),
        )
        lora = LoraReconciler(
            cluster,
            LoraClient(
                http,
                concurrency=self.config.lora_concurrency,
                request_timeout_seconds=self.config.lora_request_timeout_seconds,
                load_timeout_seconds=self.config.lora_load_timeout_seconds,
            ),
            metrics=self.metrics,
            backoff=Backoff(base_seconds=self.config.lora_backoff_seconds),
            on_change=self.trigger_lora,
            reporting_instance=socket.gethostname(),
            unload_bound_seconds=self.config.lora_unload_bound_seconds,
        )
        runner = await self._serve_metrics() if self.config.metrics_port >= 0 else None
        self._services = Services(api, cluster, reconciler, http, taints, lora, runner)

    async def _serve_metrics(self) -> web.AppRunner:
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(
                body=self.metrics.exposition(),
                headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
            )

        app = web.Application()
        app.add_routes([web.get("/metrics", metrics)])
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, self.config.metrics_host, self.config.metrics_port).start()
        logger.info(
            "Serving metrics at http://%s:%d/metrics",
            self.config.metrics_host,
            self.config.metrics_port,
        )
        return runner

    async def stop(self) -> None:
        """Close what `start()` built."""
        services, self._services = self._services, None
        if services is None:
            return
        await services.taints.close()
        await services.lora.close()
        await services.http.close()
        if services.metrics_runner is not None:
            await services.metrics_runner.cleanup()
        await services.api.close()

    def trigger(self, namespace: str, worker: str) -> None:
        """Ask for a prompt reconcile of a worker (no-op when it has no resync loop)."""
        event = self._triggers.get((namespace, worker))
        if event is not None:
            event.set()

    def trigger_event(self, namespace: str, worker: str) -> asyncio.Event:
        """The event a worker's resync loop waits on (created on first use)."""
        return self._triggers.setdefault((namespace, worker), asyncio.Event())

    def lock(self, namespace: str, worker: str) -> asyncio.Lock:
        """Serializes reconciles of one worker (change handlers and the resync loop)."""
        return self._locks.setdefault((namespace, worker), asyncio.Lock())

    def trigger_lora(self, namespace: str, name: str) -> None:
        """Ask for a prompt reconcile of a LoRAAdapter (no-op when it has no daemon)."""
        event = self._lora_triggers.get((namespace, name))
        if event is not None:
            event.set()

    def lora_trigger_event(self, namespace: str, name: str) -> asyncio.Event:
        """The event a LoRAAdapter's daemon waits on (created on first use)."""
        return self._lora_triggers.setdefault((namespace, name), asyncio.Event())

    def forget_lora(self, namespace: str, name: str) -> None:
        """Drop the trigger of a LoRAAdapter whose daemon ended."""
        self._lora_triggers.pop((namespace, name), None)

    def forget(self, namespace: str, worker: str) -> None:
        """Drop per-worker state once its resync loop ends."""
        self._triggers.pop((namespace, worker), None)
        self._locks.pop((namespace, worker), None)
