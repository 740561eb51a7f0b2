"""kopf handlers for LoRAAdapter: glue between kopf's events and `LoraReconciler`.

- A daemon per LoRAAdapter (`resync.resync_loop`) reconciles it at once, again whenever
  something it depends on changes (`loraadapter.wake` decides: its spec, a pod of a targeted
  DynamoWorker, the worker itself, one of its own requests finishing), when a failed pod's
  backoff ends, and at least every resync period (which is what notices a worker that lost
  the adapter without its pod changing).
- A deletion handler (kopf's finalizer) unloads the adapter from every pod within a bounded
  time; it never fails, so a LoRAAdapter never stays in Terminating, even when its
  DynamoWorker was deleted first. Nothing is loaded before kopf has added that finalizer
  (`resync_loop` waits for it).

What a reconcile reads comes from the indices (`indices.Indices`), never from the API server.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import kopf
from pydantic import ValidationError

from dynamo_operator.handlers.context import DYNAMO_WORKER, LORA_ADAPTER, OperatorContext
from dynamo_operator.handlers.indices import DW, LORA, Indices, is_worker_pod, namespace_of
from dynamo_operator.handlers.resync import resync_loop
from dynamo_operator.reconcile.dynamoworker.labels import worker_of
from dynamo_operator.reconcile.errors import TransientError
from dynamo_operator.reconcile.loraadapter import wake

RETRY_DELAY_SECONDS = 5.0

log = logging.getLogger(__name__)


async def reconcile_adapter(
    body: kopf.Body, memo: OperatorContext, indices: Indices
) -> float | None:
    """One reconcile; seconds until a retry is due (None: only the resync)."""
    namespace = namespace_of(body.metadata.namespace)
    started = time.monotonic()
    try:
        outcome = await memo.services.lora.reconcile(body, indices.adapter_view(namespace))
    except TransientError as err:
        log.warning("LoRAAdapter %s/%s: will retry: %s", namespace, body.metadata.name, err)
        return RETRY_DELAY_SECONDS
    except ValidationError as err:
        log.warning("LoRAAdapter %s/%s is unreadable: %s", namespace, body.metadata.name, err)
        memo.metrics.reconcile_errors.labels(kind=LORA_ADAPTER).inc()
        return None
    except Exception:
        memo.metrics.reconcile_errors.labels(kind=LORA_ADAPTER).inc()
        log.exception("LoRAAdapter %s/%s: reconcile failed", namespace, body.metadata.name)
        return RETRY_DELAY_SECONDS
    finally:
        duration = time.monotonic() - started
        memo.metrics.reconcile_duration.labels(kind=LORA_ADAPTER).observe(duration)
    memo.metrics.record_status(LORA_ADAPTER, namespace, str(body.metadata.name), outcome.status)
    return outcome.wake_in_seconds


def register(registry: kopf.OperatorRegistry) -> None:
    """Register the LoRAAdapter handlers on `registry`."""

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
        async def reconcile(full: bool) -> float | None:
            return await reconcile_adapter(body, memo, Indices.of(kwargs))

        key = (LORA_ADAPTER, namespace_of(namespace), name)
        await resync_loop(memo, key, body, stopped, reconcile)

    @kopf.on.event(*LORA, id="lora_changed", registry=registry)
    async def lora_changed(
        event: kopf.RawEvent, body: kopf.Body, name: str, namespace: str | None,
        memo: OperatorContext, **kwargs: Any,
    ) -> None:  # fmt: skip
        namespace = namespace_of(namespace)
        woken = wake.on_adapter_event(
            event.get("type"), body, Indices.of(kwargs).workers(namespace)
        )
        if woken.adapter:
            memo.wake(LORA_ADAPTER, namespace, name)
        for worker in woken.workers:
            memo.wake(DYNAMO_WORKER, namespace, worker)

    @kopf.on.delete(*LORA, id="lora_unload", registry=registry)
    async def lora_unload(
        body: kopf.Body, name: str, namespace: str | None, memo: OperatorContext, **kwargs: Any
    ) -> None:
        namespace = namespace_of(namespace)
        indices = Indices.of(kwargs)
        try:
            report = await memo.services.lora.finalize(body, indices.adapter_view(namespace))
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

    @kopf.on.event("v1", "pods", id="lora_pod_changed", when=is_worker_pod, registry=registry)
    async def lora_pod_changed(
        event: kopf.RawEvent,
        name: str,
        namespace: str | None,
        labels: kopf.Labels,
        memo: OperatorContext,
        **kwargs: Any,
    ) -> None:
        namespace = namespace_of(namespace)
        worker = worker_of(labels)
        if worker is None:  # is_worker_pod lets none of these through
            return
        if event.get("type") == "DELETED":
            memo.services.lora.forget_pod(namespace, name)
        indices = Indices.of(kwargs)
        for adapter in wake.on_pod_event(
            event.get("type"),
            worker,
            indices.workers(namespace),
            indices.adapters(namespace),
        ):
            memo.wake(LORA_ADAPTER, namespace, adapter)

    @kopf.on.event(*DW, id="lora_worker_changed", registry=registry)
    async def lora_worker_changed(
        event: kopf.RawEvent, name: str, namespace: str | None, memo: OperatorContext,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        namespace = namespace_of(namespace)
        indices = Indices.of(kwargs)
        for adapter in wake.on_worker_event(
            event.get("type"), name, indices.workers(namespace), indices.adapters(namespace)
        ):
            memo.wake(LORA_ADAPTER, namespace, adapter)
