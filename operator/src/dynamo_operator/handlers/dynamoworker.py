"""kopf handlers for DynamoWorker: glue between kopf's events and `WorkerReconciler`.

- One reconcile on create, update and resume (kopf retries it on transient errors).
- A daemon per DynamoWorker that reconciles again whenever one of its children changes
  (Deployment, pods, the pods' DynamoWorkerMetadata: a debounced trigger) and at least every
  resync period (repairing drift no watch reports, such as a deleted Role).
- In-memory indices of the worker pods and their DynamoWorkerMetadata, filled from kopf's
  watches, so computing status needs no API reads.

Indices reach handlers as keyword arguments named after the index functions. Handlers return
nothing (kopf would store a return value in status). Per-worker reconciles
are serialized by a lock, so a change handler and the daemon never interleave.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any

import kopf
from pydantic import ValidationError

from dynamo_operator.api.metadata import DynamoWorkerMetadata
from dynamo_operator.handlers.context import OperatorContext
from dynamo_operator.reconcile.labels import MANAGED_BY, WORKER_LABEL
from dynamo_operator.reconcile.lora import AdapterRef, WorkerInfo, required_adapters
from dynamo_operator.reconcile.observed import PodSummary
from dynamo_operator.reconcile.worker import TransientError

KIND = "DynamoWorker"
DW = ("dynamo.dev", "v1alpha1", "dynamoworkers")
DWM = ("nvidia.com", "v1alpha1", "dynamoworkermetadatas")
MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}
RETRY_DELAY_SECONDS = 5.0

log = logging.getLogger(__name__)


def _namespace(namespace: str | None) -> str:
    # Every kind handled here is namespaced; kopf types the argument for cluster kinds too.
    if namespace is None:
        raise kopf.PermanentError("a namespaced object arrived without a namespace")
    return namespace


def _first(values: Iterable[Any] | None) -> Any:
    return next(iter(values), None) if values is not None else None


async def reconcile_now(
    body: kopf.Body, memo: OperatorContext, indices: dict[str, Any], *, full: bool = True
) -> None:
    """Reconcile one DynamoWorker with what the indices (kopf's, by id) hold; raises
    TransientError. `full=False`: a status refresh after child events (see
    `WorkerReconciler.reconcile`)."""
    worker_pods: kopf.Index[tuple[str, str], PodSummary] = indices["worker_pods"]
    worker_metadata: kopf.Index[tuple[str, str], DynamoWorkerMetadata] = indices["worker_metadata"]
    adapters: kopf.Index[str, AdapterRef] = indices["lora_adapters"]
    namespace, name = str(body.metadata.namespace), str(body.metadata.name)
    worker = WorkerInfo(name=name, labels=dict(body.metadata.labels or {}))
    required = required_adapters(worker, list(adapters.get(namespace, [])))
    pods = list(worker_pods.get((namespace, name), []))
    metadata = {}
    for pod in pods:
        record = _first(worker_metadata.get((namespace, pod.name)))
        if record is not None:
            metadata[pod.name] = record
    started = time.monotonic()
    async with memo.lock(namespace, name):
        try:
            outcome = await memo.services.reconciler.reconcile(
                body, pods, metadata, full=full, required=required
            )
        except Exception:
            memo.metrics.reconcile_errors.labels(kind=KIND).inc()
            raise
        finally:
            memo.metrics.reconcile_duration.labels(kind=KIND).observe(time.monotonic() - started)
    if outcome.applied:
        log.info("Applied %s for DynamoWorker %s/%s", ", ".join(outcome.applied), namespace, name)
    if outcome.spec_error:
        # Once per change of status, not once per resync.
        level = logging.WARNING if outcome.status_written else logging.DEBUG
        log.log(level, "DynamoWorker %s/%s not reconciled: %s", namespace, name, outcome.spec_error)


def register(registry: kopf.OperatorRegistry) -> None:
    """Register the DynamoWorker handlers on `registry`."""

    @kopf.index(
        "v1", "pods", id="worker_pods", labels={WORKER_LABEL: kopf.PRESENT}, registry=registry
    )
    async def worker_pods(
        body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any
    ) -> dict[tuple[str, str], PodSummary]:
        return {(_namespace(namespace), labels[WORKER_LABEL]): PodSummary.from_pod(body)}

    @kopf.index(
        "v1", "pods", id="pod_workers", labels={WORKER_LABEL: kopf.PRESENT}, registry=registry
    )
    async def pod_workers(
        name: str, namespace: str | None, labels: kopf.Labels, **_: Any
    ) -> dict[tuple[str, str], str]:
        return {(_namespace(namespace), name): labels[WORKER_LABEL]}

    @kopf.index(*DWM, id="worker_metadata", registry=registry)
    async def worker_metadata(
        body: kopf.Body, name: str, namespace: str | None, **_: Any
    ) -> dict[tuple[str, str], DynamoWorkerMetadata]:
        try:
            record = DynamoWorkerMetadata.model_validate(dict(body))
            return {(_namespace(namespace), name): record}
        except ValidationError as err:
            log.warning("Ignoring unreadable DynamoWorkerMetadata %s: %s", name, err)
            return {}

    @kopf.on.resume(*DW, id="reconcile", registry=registry, backoff=RETRY_DELAY_SECONDS)
    @kopf.on.create(*DW, id="reconcile", registry=registry, backoff=RETRY_DELAY_SECONDS)
    @kopf.on.update(*DW, id="reconcile", registry=registry, backoff=RETRY_DELAY_SECONDS)
    async def reconcile_dynamoworker(
        body: kopf.Body,
        memo: OperatorContext,
        **kwargs: Any,
    ) -> None:
        try:
            await reconcile_now(body, memo, kwargs)
        except TransientError as err:
            raise kopf.TemporaryError(str(err), delay=RETRY_DELAY_SECONDS) from err

    @kopf.daemon(
        *DW, id="resync", registry=registry, cancellation_backoff=2.0, cancellation_timeout=5.0
    )
    async def resync_dynamoworker(
        body: kopf.Body,
        name: str,
        namespace: str | None,
        uid: str,
        memo: OperatorContext,
        stopped: kopf.DaemonStopped,
        **kwargs: Any,
    ) -> None:
        namespace = _namespace(namespace)
        trigger = memo.trigger_event(namespace, name)
        memo.metrics.managed_objects.labels(kind=KIND).inc()
        resync = memo.config.resync_seconds
        last_full = time.monotonic()  # the create or resume handler has just done one
        try:
            while not stopped:
                due = last_full + resync - time.monotonic()
                triggered = await _wait(trigger, stopped, max(due, 0.0))
                if stopped:
                    break
                trigger.clear()
                # Let a burst of child events (a rollout) settle into one reconcile.
                await asyncio.sleep(memo.config.debounce_seconds)
                # A full pass when the resync is due, even while events keep coming.
                full = not triggered or time.monotonic() - last_full >= resync
                if full:
                    last_full = time.monotonic()
                try:
                    await reconcile_now(body, memo, kwargs, full=full)
                except TransientError as err:
                    log.warning("DynamoWorker %s/%s: will retry: %s", namespace, name, err)
                except Exception:
                    log.exception(
                        "DynamoWorker %s/%s: reconcile failed; retrying at the next resync",
                        namespace,
                        name,
                    )
        finally:
            memo.metrics.managed_objects.labels(kind=KIND).dec()
            memo.forget(namespace, name)
            memo.services.reconciler.forget(namespace, name, uid)

    @kopf.on.event(
        "apps", "v1", "deployments", id="deployment_changed", labels=MANAGED, registry=registry
    )
    async def deployment_changed(
        event: kopf.RawEvent,
        namespace: str | None,
        labels: kopf.Labels,
        memo: OperatorContext,
        **_: Any,
    ) -> None:
        if event.get("type") is not None and WORKER_LABEL in labels:
            memo.trigger(_namespace(namespace), labels[WORKER_LABEL])

    @kopf.on.event(
        "v1", "pods", id="pod_changed", labels={WORKER_LABEL: kopf.PRESENT}, registry=registry
    )
    async def pod_changed(
        event: kopf.RawEvent,
        namespace: str | None,
        labels: kopf.Labels,
        memo: OperatorContext,
        **_: Any,
    ) -> None:
        if event.get("type") is not None:
            memo.trigger(_namespace(namespace), labels[WORKER_LABEL])

    @kopf.on.event(*DWM, id="metadata_changed", registry=registry)
    async def metadata_changed(
        event: kopf.RawEvent,
        name: str,
        namespace: str | None,
        memo: OperatorContext,
        **kwargs: Any,
    ) -> None:
        pod_workers: kopf.Index[tuple[str, str], str] = kwargs["pod_workers"]
        key = (_namespace(namespace), name)
        worker = _first(pod_workers.get(key))
        if event.get("type") is not None and worker is not None:
            memo.trigger(key[0], worker)


async def _wait(trigger: asyncio.Event, stopped: kopf.DaemonStopped, seconds: float) -> bool:
    """Until the trigger is set, the daemon is stopped, or `seconds` pass; whether the
    trigger was set."""
    waiters = [
        asyncio.ensure_future(trigger.wait()),
        asyncio.ensure_future(stopped.wait()),
    ]
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*waiters, return_exceptions=True)
    return trigger.is_set()
