"""kopf handlers for LoRAAdapter: glue between kopf's events and `LoraReconciler`.

- A daemon per LoRAAdapter reconciles it at once, again whenever something it depends on
  changes (its spec, a pod of a targeted DynamoWorker, the worker itself, one of its own
  requests finishing: a debounced trigger), when a failed pod's backoff ends, and at least
  every resync period (which is what notices a worker that lost the adapter without its pod
  changing).
- A deletion handler (kopf's finalizer) unloads the adapter from every pod within a bounded
  time; it never fails, so a LoRAAdapter never stays in Terminating, even when its
  DynamoWorker was deleted first.
- Indices of the namespace's DynamoWorkers and LoRAAdapters (the worker pods' index is the
  DynamoWorker handlers'), so a reconcile reads nothing from the API server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import kopf
from pydantic import ValidationError

from dynamo_operator.api.dynamoworker import DEFAULT_MAX_LORAS
from dynamo_operator.api.loraadapter import LoRAAdapter
from dynamo_operator.handlers.context import OperatorContext
from dynamo_operator.handlers.dynamoworker import DW, _namespace, _wait
from dynamo_operator.reconcile.labels import WORKER_LABEL
from dynamo_operator.reconcile.lora import AdapterRef, Pod, WorkerInfo
from dynamo_operator.reconcile.observed import PodSummary
from dynamo_operator.reconcile.worker import TransientError

KIND = "LoRAAdapter"
LORA = ("dynamo.dev", "v1alpha1", "loraadapters")
RETRY_DELAY_SECONDS = 5.0

log = logging.getLogger(__name__)


def _worker_info(name: str, labels: Any, spec: Any) -> WorkerInfo:
    lora = (spec or {}).get("lora") or {}
    enabled = bool(lora.get("enabled", False))
    max_loras = lora.get("maxLoras")
    if not isinstance(max_loras, int):
        max_loras = DEFAULT_MAX_LORAS if enabled else None
    return WorkerInfo(
        name=name, labels=dict(labels or {}), lora_enabled=enabled, max_loras=max_loras
    )


class _Indices:
    """The indices a LoRAAdapter reconcile reads, for one namespace."""

    def __init__(self, namespace: str, kwargs: dict[str, Any]) -> None:
        self.namespace = namespace
        self._workers: kopf.Index[str, WorkerInfo] = kwargs["dynamo_workers"]
        self._adapters: kopf.Index[str, AdapterRef] = kwargs["lora_adapters"]
        self._pods: kopf.Index[tuple[str, str], PodSummary] = kwargs["worker_pods"]

    def workers(self) -> list[WorkerInfo]:
        return list(self._workers.get(self.namespace, []))

    def adapters(self) -> list[AdapterRef]:
        return list(self._adapters.get(self.namespace, []))

    def pods_of(self, worker: str) -> Sequence[Pod]:
        return [
            # Containers ready, not pod Ready: a pod whose readiness waits for its required
            # adapters (the readiness gate) must still get them.
            Pod(
                name=p.name,
                worker=worker,
                ip=p.ip,
                ready=p.containers_ready,
                terminating=p.terminating,
            )
            for p in self._pods.get((self.namespace, worker), [])
        ]

    def workers_targeted_by(self, body: kopf.Body) -> list[str]:
        """The DynamoWorkers the LoRAAdapter `body` targets (none when it is unreadable)."""
        try:
            adapter = LoRAAdapter.model_validate({**dict(body), "status": None})
        except ValidationError:
            return []
        ref = AdapterRef.of(adapter)
        return [w.name for w in self.workers() if ref.targets(w)]

    def adapters_targeting(self, worker: str) -> list[str]:
        known = {w.name: w for w in self.workers()}
        info = known.get(worker) or WorkerInfo(worker)
        return [ref.name for ref in self.adapters() if ref.targets(info)]


async def reconcile_adapter(
    body: kopf.Body, memo: OperatorContext, kwargs: dict[str, Any]
) -> float | None:
    """One reconcile; seconds until a retry is due (None: only the resync)."""
    namespace = _namespace(body.metadata.namespace)
    indices = _Indices(namespace, kwargs)
    started = time.monotonic()
    try:
        outcome = await memo.services.lora.reconcile(
            body, indices.workers(), indices.pods_of, indices.adapters()
        )
    except TransientError as err:
        log.warning("LoRAAdapter %s/%s: will retry: %s", namespace, body.metadata.name, err)
        return RETRY_DELAY_SECONDS
    except ValidationError as err:
        log.warning("LoRAAdapter %s/%s is unreadable: %s", namespace, body.metadata.name, err)
        memo.metrics.reconcile_errors.labels(kind=KIND).inc()
        return None
    except Exception:
        memo.metrics.reconcile_errors.labels(kind=KIND).inc()
        log.exception("LoRAAdapter %s/%s: reconcile failed", namespace, body.metadata.name)
        return RETRY_DELAY_SECONDS
    finally:
        memo.metrics.reconcile_duration.labels(kind=KIND).observe(time.monotonic() - started)
    return outcome.wake_in_seconds


def register(registry: kopf.OperatorRegistry) -> None:
    """Register the LoRAAdapter handlers on `registry`."""

    @kopf.index(*DW, id="dynamo_workers", registry=registry)
    async def dynamo_workers(
        name: str, namespace: str | None, labels: kopf.Labels, spec: kopf.Spec, **_: Any
    ) -> dict[str, WorkerInfo]:
        return {_namespace(namespace): _worker_info(name, labels, spec)}

    @kopf.index(*LORA, id="lora_adapters", registry=registry)
    async def lora_adapters(
        body: kopf.Body, name: str, namespace: str | None, **_: Any
    ) -> dict[str, AdapterRef]:
        try:
            adapter = LoRAAdapter.model_validate({**dict(body), "status": None})
        except ValidationError as err:
            log.warning("Ignoring unreadable LoRAAdapter %s: %s", name, err)
            return {}
        return {_namespace(namespace): AdapterRef.of(adapter, body.get("status"))}

    @kopf.daemon(
        *LORA,
        id="lora_sync",
        registry=registry,
        cancellation_backoff=1.0,
        cancellation_timeout=10.0,
    )
    async def lora_sync(
        body: kopf.Body,
        name: str,
        namespace: str | None,
        memo: OperatorContext,
        stopped: kopf.DaemonStopped,
        **kwargs: Any,
    ) -> None:
        namespace = _namespace(namespace)
        trigger = memo.lora_trigger_event(namespace, name)
        memo.metrics.managed_objects.labels(kind=KIND).inc()
        resync = memo.config.resync_seconds
        try:
            while not stopped:
                trigger.clear()
                wake = await reconcile_adapter(body, memo, kwargs)
                wait = resync if wake is None else min(resync, max(wake, 0.05))
                await _wait(trigger, stopped, wait)
                if stopped:
                    break
                # Let a burst of events (pods becoming ready, loads finishing) settle.
                await asyncio.sleep(memo.config.debounce_seconds)
        finally:
            memo.metrics.managed_objects.labels(kind=KIND).dec()
            memo.forget_lora(namespace, name)

    @kopf.on.event(*LORA, id="lora_changed", registry=registry)
    async def lora_changed(
        event: kopf.RawEvent, body: kopf.Body, name: str, namespace: str | None,
        memo: OperatorContext, **kwargs: Any,
    ) -> None:  # fmt: skip
        if event.get("type") is None:
            return  # the initial listing: every daemon reconciles on start anyway
        namespace = _namespace(namespace)
        # A spec change (a new generation); our own status writes do not trigger.
        observed = (body.get("status") or {}).get("observedGeneration")
        spec_changed = observed != body.metadata.get("generation")
        if event.get("type") == "MODIFIED" and spec_changed:
            memo.trigger_lora(namespace, name)
        # The readiness gate of the workers it targets follows a required adapter's per-pod
        # states (its status), and whether there is one at all (its spec, its deletion).
        required = bool((body.get("spec") or {}).get("requiredForReadiness"))
        if required or spec_changed or event.get("type") == "DELETED":
            for worker in _Indices(namespace, kwargs).workers_targeted_by(body):
                memo.trigger(namespace, worker)

    @kopf.on.delete(*LORA, id="lora_unload", registry=registry)
    async def lora_unload(
        body: kopf.Body, name: str, namespace: str | None, memo: OperatorContext, **kwargs: Any
    ) -> None:
        namespace = _namespace(namespace)
        indices = _Indices(namespace, kwargs)
        try:
            report = await memo.services.lora.finalize(
                body, indices.workers(), indices.pods_of, indices.adapters()
            )
        except Exception:  # never block the deletion
            log.exception("LoRAAdapter %s/%s: unloading failed; deleting anyway", namespace, name)
            return
        log.info(
            "LoRAAdapter %s/%s deleted: unloaded from %d pod(s), %d could not be reached%s",
            namespace,
            name,
            len(report.unloaded),
            len(report.failed),
            f" (skipped: {report.skipped})" if report.skipped else "",
        )

    @kopf.on.event(
        "v1", "pods", id="lora_pod_changed", labels={WORKER_LABEL: kopf.PRESENT}, registry=registry
    )
    async def lora_pod_changed(
        event: kopf.RawEvent,
        name: str,
        namespace: str | None,
        labels: kopf.Labels,
        memo: OperatorContext,
        **kwargs: Any,
    ) -> None:
        if event.get("type") is None:
            return  # the initial listing: every daemon reconciles on start anyway
        namespace = _namespace(namespace)
        if event.get("type") == "DELETED":
            memo.services.lora.forget_pod(namespace, name)
        for adapter in _Indices(namespace, kwargs).adapters_targeting(labels[WORKER_LABEL]):
            memo.trigger_lora(namespace, adapter)

    @kopf.on.event(*DW, id="lora_worker_changed", registry=registry)
    async def lora_worker_changed(
        event: kopf.RawEvent, name: str, namespace: str | None, memo: OperatorContext,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        # A worker appearing or going away changes what its adapters target; other changes
        # reach them through the pods (or the resync).
        if event.get("type") not in ("ADDED", "DELETED"):
            return
        namespace = _namespace(namespace)
        for adapter in _Indices(namespace, kwargs).adapters_targeting(name):
            memo.trigger_lora(namespace, adapter)
