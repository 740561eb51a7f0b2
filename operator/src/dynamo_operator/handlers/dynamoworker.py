"""kopf handlers for DynamoWorker: glue between kopf's events and `WorkerReconciler`.

- A daemon per DynamoWorker (`resync.resync_loop`) is its one reconciler: it reconciles as
  soon as kopf sees the object (a new one, or every one when the operator starts) and kopf's
  finalizer is on it, again
  whenever the DynamoWorker or one of its children changes (any child the operator applies,
  its pods, their DynamoWorkerMetadata), after `RETRY_DELAY_SECONDS` when the API server
  refused, and at least every resync period.
- With spec.prefill, a daemon reads both roles' KV-transfer counters every
  `KV_TRANSFER_POLL_SECONDS` (`KvTransferMonitor`), waking the reconciler when what status
  shows of them changes.
- The DynamoWorker's own watch events wake it, except the echo of our own status write.
  There is no create or update handler: kopf would store a diff base on every object for
  it (one more PATCH each), and a second path into the reconciler.

What a reconcile reads comes from the indices (`indices.Indices`), children included, so a
pass over a converged worker sends no request. Handlers return nothing (kopf would store a
return value in status). Per-worker reconciles are serialized by a lock; all reconciles share
the context's bounded slots.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import kopf
from pydantic import ValidationError

from dynamo_operator.api.dynamoworker import DynamoWorker
from dynamo_operator.handlers.context import DYNAMO_WORKER, OperatorContext
from dynamo_operator.handlers.indices import (
    CHILD_KINDS,
    DW,
    DWM,
    MANAGED,
    Indices,
    is_worker_pod,
    namespace_of,
    resource_of,
)
from dynamo_operator.handlers.resync import resync_loop
from dynamo_operator.k8s import kinds
from dynamo_operator.k8s.client import ApiError
from dynamo_operator.reconcile.children import key_of
from dynamo_operator.reconcile.dynamoworker.activator import activator_ip
from dynamo_operator.reconcile.dynamoworker.labels import OWNER_KIND, activator_name, worker_of
from dynamo_operator.reconcile.errors import TransientError
from dynamo_operator.reconcile.events import Regarding
from dynamo_operator.reconcile.loraadapter.targeting import WorkerInfo, required_adapters

RETRY_DELAY_SECONDS = 5.0
# How often the autoscaler reads each autoscaled DynamoWorker's pods.
AUTOSCALE_POLL_SECONDS = 2.0
# How often the KV-transfer monitor reads each disaggregated DynamoWorker's pods.
KV_TRANSFER_POLL_SECONDS = 10.0

log = logging.getLogger(__name__)


async def reconcile_now(body: kopf.Body, memo: OperatorContext, indices: Indices) -> float | None:
    """Reconcile one DynamoWorker with what the indices hold; the seconds until it wants to
    run again (None: at the next trigger or resync). Raises TransientError."""
    namespace, name = namespace_of(body.metadata.namespace), str(body.metadata.name)
    worker = WorkerInfo(name=name, labels=dict(body.metadata.labels or {}))
    required = required_adapters(worker, indices.adapters(namespace))
    pods = indices.pods(namespace, name)
    metadata = indices.metadata(namespace, pods)
    started = time.monotonic()
    async with memo.lock(DYNAMO_WORKER, namespace, name):
        try:
            outcome = await memo.services.reconciler.reconcile(
                body,
                pods,
                metadata,
                required=required,
                index=indices.children(memo.watched_children),
            )
        except Exception:
            memo.metrics.reconcile_errors.labels(kind=DYNAMO_WORKER).inc()
            raise
        finally:
            duration = time.monotonic() - started
            memo.metrics.reconcile_duration.labels(kind=DYNAMO_WORKER).observe(duration)
    # spec.replicas always holds an integer: the CRD types it and defaults it.
    desired = None if outcome.spec_error else body.spec.get("replicas")
    memo.metrics.record_status(DYNAMO_WORKER, namespace, name, outcome.status, desired)
    if outcome.applied:
        log.info("Applied %s for DynamoWorker %s/%s", ", ".join(outcome.applied), namespace, name)
    if outcome.spec_error:
        # Once per change of status, not once per resync.
        level = logging.WARNING if outcome.status_written else logging.DEBUG
        log.log(level, "DynamoWorker %s/%s not reconciled: %s", namespace, name, outcome.spec_error)
    return outcome.wake_in_seconds


async def autoscale_once(body: kopf.Body, memo: OperatorContext, indices: Indices) -> None:
    """One autoscaler step for the DynamoWorker `body` (its live copy: kopf keeps it
    current), with its pods and activator from the indices; failures are logged and the next
    step tries again."""
    namespace, name = namespace_of(body.metadata.namespace), str(body.metadata.name)
    try:
        dw = DynamoWorker.model_validate(dict(body))
    except ValidationError:
        return  # the reconciler reports the spec error in status
    spec = dw.spec.autoscaling
    if spec is None or dw.metadata.deletion_timestamp is not None:
        return
    children = indices.children(memo.watched_children)
    slice_ = children.get(key_of(kinds.ENDPOINT_SLICE, namespace, activator_name(name)))
    activator = activator_ip(slice_.body() if slice_ is not None else None)
    try:
        await memo.services.autoscaler.step(
            Regarding.of(kinds.DYNAMO_WORKER, body.metadata),
            spec,
            dw.spec.replicas,
            dw.status.autoscaling if dw.status is not None else None,
            indices.pods(namespace, name),
            activator,
        )
    except ApiError as err:
        log.warning("DynamoWorker %s/%s: autoscaler: %s", namespace, name, err)


def register(registry: kopf.OperatorRegistry) -> None:
    """Register the DynamoWorker handlers on `registry`."""

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
        namespace = namespace_of(namespace)

        async def reconcile(full: bool) -> float | None:
            # Every pass is a full one: the children are read from memory.
            try:
                return await reconcile_now(body, memo, Indices.of(kwargs))
            except TransientError as err:
                log.warning(
                    "DynamoWorker %s/%s: will retry in %.0f s: %s",
                    namespace,
                    name,
                    RETRY_DELAY_SECONDS,
                    err,
                )
                return RETRY_DELAY_SECONDS
            except Exception:
                log.exception(
                    "DynamoWorker %s/%s: reconcile failed; retrying at the next resync",
                    namespace,
                    name,
                )
            return None

        try:
            await resync_loop(memo, (DYNAMO_WORKER, namespace, name), body, stopped, reconcile)
        finally:
            memo.services.reconciler.forget(namespace, name, uid)

    @kopf.daemon(
        *DW,
        id="autoscale",
        registry=registry,
        when=lambda spec, **_: bool(spec.get("autoscaling")),
        cancellation_timeout=5.0,
    )
    async def autoscale_dynamoworker(
        body: kopf.Body,
        name: str,
        namespace: str | None,
        memo: OperatorContext,
        stopped: kopf.DaemonStopped,
        **kwargs: Any,
    ) -> None:
        namespace = namespace_of(namespace)
        try:
            while not stopped:
                await autoscale_once(body, memo, Indices.of(kwargs))
                await stopped.wait(AUTOSCALE_POLL_SECONDS)
        finally:
            memo.services.autoscaler.forget(namespace, name)

    @kopf.daemon(
        *DW,
        id="kv_transfer",
        registry=registry,
        when=lambda spec, **_: bool(spec.get("prefill")),
        cancellation_timeout=5.0,
    )
    async def monitor_kv_transfer(
        name: str,
        namespace: str | None,
        memo: OperatorContext,
        stopped: kopf.DaemonStopped,
        **kwargs: Any,
    ) -> None:
        namespace = namespace_of(namespace)
        indices = Indices.of(kwargs)
        try:
            while not stopped:
                await memo.services.kv_transfer.step(namespace, name, indices.pods(namespace, name))
                await stopped.wait(KV_TRANSFER_POLL_SECONDS)
        finally:
            memo.services.kv_transfer.forget(namespace, name)

    @kopf.on.event(*DW, id="dynamoworker_changed", registry=registry)
    async def dynamoworker_changed(
        event: kopf.RawEvent,
        name: str,
        namespace: str | None,
        meta: kopf.Meta,
        memo: OperatorContext,
        **_: Any,
    ) -> None:
        # The initial listing needs nothing: every daemon reconciles when it starts.
        if event.get("type") is None or memo.services.reconciler.is_echo(meta):
            return
        memo.wake(DYNAMO_WORKER, namespace_of(namespace), name)

    for kind in CHILD_KINDS:
        _register_child_changed(registry, kind)

    @kopf.on.event(*resource_of(kinds.POD), id="pod_changed", when=is_worker_pod, registry=registry)
    async def pod_changed(
        event: kopf.RawEvent,
        namespace: str | None,
        labels: kopf.Labels,
        memo: OperatorContext,
        **_: Any,
    ) -> None:
        worker = worker_of(labels)
        if event.get("type") is not None and worker is not None:
            memo.wake(DYNAMO_WORKER, namespace_of(namespace), worker)

    @kopf.on.event(*DWM, id="metadata_changed", registry=registry)
    async def metadata_changed(
        event: kopf.RawEvent,
        name: str,
        namespace: str | None,
        memo: OperatorContext,
        **kwargs: Any,
    ) -> None:
        namespace = namespace_of(namespace)
        worker = Indices.of(kwargs).worker_of_pod(namespace, name)
        if event.get("type") is not None and worker is not None:
            memo.wake(DYNAMO_WORKER, namespace, worker)


def _owner(meta: kopf.Meta) -> str | None:
    """The DynamoWorker that controls a child (its controller owner reference)."""
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == OWNER_KIND:
            return str(ref.get("name"))
    return None


def _register_child_changed(registry: kopf.OperatorRegistry, kind: kinds.Kind) -> None:
    @kopf.on.event(
        *resource_of(kind), id=f"{kind.plural}_changed", labels=MANAGED, registry=registry
    )
    async def child_changed(
        event: kopf.RawEvent,
        name: str,
        namespace: str | None,
        meta: kopf.Meta,
        memo: OperatorContext,
        **_: Any,
    ) -> None:
        if event.get("type") is None:  # the initial listing: nothing changed
            return
        namespace = namespace_of(namespace)
        memo.services.reconciler.children.seen(key_of(kind, namespace, name))
        owner = _owner(meta)
        if owner is not None:
            memo.wake(DYNAMO_WORKER, namespace, owner)
