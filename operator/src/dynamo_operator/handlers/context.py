"""The services built at startup and the per-object wake-ups (kopf's memo).

`OperatorContext` is the memo kopf hands every handler: it starts empty, `start()` builds the
API client, the reconcilers (DynamoWorker and LoRAAdapter), the pod clients and the metrics
server once the event loop runs, and `stop()` closes them. Its `__copy__` returns itself, so
the per-object memos kopf makes are all this one shared context.
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

from dynamo_operator.handlers.fence import WriteFence
from dynamo_operator.handlers.indices import CHILD_KINDS
from dynamo_operator.handlers.metrics_server import serve_metrics
from dynamo_operator.handlers.settings import METRICS_HOST, OperatorConfig
from dynamo_operator.k8s import kinds
from dynamo_operator.k8s.client import ApiError, Cluster, connect
from dynamo_operator.metrics import OperatorMetrics
from dynamo_operator.pods.adapters import LoraClient
from dynamo_operator.pods.credentials import BearerToken
from dynamo_operator.pods.load import LoadReader
from dynamo_operator.pods.taints import TaintPusher
from dynamo_operator.reconcile.crds import install_crds
from dynamo_operator.reconcile.dynamoworker.autoscaler import Autoscaler
from dynamo_operator.reconcile.dynamoworker.kv_transfer import KvTransferMonitor
from dynamo_operator.reconcile.dynamoworker.reconciler import WorkerReconciler
from dynamo_operator.reconcile.dynamoworker.settings import ReconcileSettings
from dynamo_operator.reconcile.events import EventRecorder
from dynamo_operator.reconcile.loraadapter.reconciler import LoraReconciler

logger = logging.getLogger(__name__)

DYNAMO_WORKER = "DynamoWorker"
# Reconciles running at once, all objects together: a burst of objects queues here rather than
# at the API server, and triggers that arrive while an object waits join its next pass.
MAX_PARALLEL_RECONCILES = 16
LORA_ADAPTER = "LoRAAdapter"
ObjectKey = tuple[str, str, str]  # (kind, namespace, name)


@dataclass
class Services:
    """What `OperatorContext.start()` builds."""

    api: client.ApiClient
    cluster: Cluster
    reconciler: WorkerReconciler
    http: aiohttp.ClientSession
    taints: TaintPusher
    lora: LoraReconciler
    autoscaler: Autoscaler
    kv_transfer: KvTransferMonitor


@dataclass
class OperatorContext:
    """Shared state of one operator process (kopf's memo)."""

    config: OperatorConfig
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    # Leader election's write fence (handlers.leadership), checked before every write.
    fence: Callable[[], None] | None = None
    started_at: float = field(default_factory=time.monotonic)
    # Every kopf watcher task seen running (the liveness check reports one that has gone).
    watchers: frozenset[str] = frozenset()
    _services: Services | None = None
    _metrics_runner: web.AppRunner | None = None
    # The children's kinds kopf watches, so reconciles read them from its indices.
    watched_children: frozenset[str] = frozenset()
    reconcile_slots: asyncio.Semaphore = field(
        default_factory=lambda: asyncio.Semaphore(MAX_PARALLEL_RECONCILES)
    )
    _triggers: dict[ObjectKey, asyncio.Event] = field(default_factory=dict)
    _locks: dict[ObjectKey, asyncio.Lock] = field(default_factory=dict)

    def __copy__(self) -> Self:
        return self

    @property
    def services(self) -> Services:
        if self._services is None:
            raise RuntimeError("the operator context is not started")
        return self._services

    async def start(self) -> None:
        """Build the clients and servers; install the CRDs when configured to."""
        api = await connect()
        cluster = Cluster(api, self.metrics, fence=self.fence)
        if self.config.install_crds:
            written = await install_crds(cluster)
            if written:
                logger.info("Installed CRDs: %s", ", ".join(written))
        middlewares: tuple[aiohttp.ClientMiddlewareType, ...] = (
            BearerToken(self.config.worker_token_file),
        )
        if self.fence is not None:
            middlewares = (WriteFence(self.fence), *middlewares)
        http = aiohttp.ClientSession(middlewares=middlewares)

        def wake_worker(namespace: str, name: str) -> None:
            self.wake(DYNAMO_WORKER, namespace, name)

        taints = TaintPusher(
            http,
            on_done=wake_worker,
            metrics=self.metrics,
        )
        reader = LoadReader(http)
        autoscaler = Autoscaler(
            cluster,
            reader,
            EventRecorder(cluster, socket.gethostname()),
            self.metrics,
            on_change=wake_worker,
        )
        kv_transfer = KvTransferMonitor(reader, on_change=wake_worker)
        reconciler = WorkerReconciler(
            cluster,
            ReconcileSettings(
                worker_image=self.config.worker_image,
                vllm_worker_image=self.config.vllm_worker_image,
                worker_image_pull_secrets=self.config.worker_image_pull_secrets,
                frontend_image=self.config.frontend_image,
                operator_namespace=self.config.operator_namespace,
            ),
            taints,
            reporting_instance=socket.gethostname(),
            autoscaling=autoscaler.view,
            kv_transfer=kv_transfer.view,
        )
        lora = LoraReconciler(
            cluster,
            LoraClient(http),
            metrics=self.metrics,
            on_change=lambda namespace, name: self.wake(LORA_ADAPTER, namespace, name),
            reporting_instance=socket.gethostname(),
        )
        self.watched_children = await watched_children(reconciler)
        await self.serve_metrics()
        self._services = Services(
            api, cluster, reconciler, http, taints, lora, autoscaler, kv_transfer
        )

    async def serve_metrics(self) -> None:
        """Start `/metrics` unless disabled or already started (a standby serves it before
        `start()`, with leader election)."""
        if self.config.metrics_port >= 0 and self._metrics_runner is None:
            self._metrics_runner = await serve_metrics(
                self.metrics, METRICS_HOST, self.config.metrics_port
            )

    async def stop(self) -> None:
        """Close what `start()` built."""
        services, self._services = self._services, None
        if services is None:
            return
        await services.taints.close()
        await services.lora.close()
        await services.http.close()
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None
        await services.api.close()

    def wake(self, kind: str, namespace: str, name: str) -> None:
        """Ask for a prompt reconcile of an object (no-op when it has no resync loop)."""
        event = self._triggers.get((kind, namespace, name))
        if event is not None:
            event.set()

    def trigger(self, kind: str, namespace: str, name: str) -> asyncio.Event:
        """The event an object's resync loop waits on (created on first use)."""
        return self._triggers.setdefault((kind, namespace, name), asyncio.Event())

    def lock(self, kind: str, namespace: str, name: str) -> asyncio.Lock:
        """Serializes reconciles of one object (change handlers and its resync loop)."""
        return self._locks.setdefault((kind, namespace, name), asyncio.Lock())

    def forget(self, kind: str, namespace: str, name: str) -> None:
        """Drop an object's trigger and lock once its resync loop ends."""
        self._triggers.pop((kind, namespace, name), None)
        self._locks.pop((kind, namespace, name), None)


async def watched_children(reconciler: WorkerReconciler) -> frozenset[str]:
    """The child kinds kopf will watch: it discovers resources once, after startup, so
    PodMonitors only when their CRD is installed now (else they are read from the API server)."""
    try:
        pod_monitors = (await reconciler.refresh_cluster_facts()).pod_monitor_crd
    except ApiError:
        pod_monitors = False
    return frozenset(k.kind for k in CHILD_KINDS if k is not kinds.POD_MONITOR or pod_monitors)
