"""Reconciling one DynamoWorker: apply its children, read them back, write its status.

Level-based and idempotent: every run recomputes the desired children from the spec, applies
those whose live copy differs (see `reconcile.converge`), removes the PodMonitor when it is no
longer wanted, pushes model taints where pods lag behind, computes status from what it sees,
and writes status only when it changed. At zero it keeps the last pod until the activator
stands in (`handover`); when that hand-over began is the one thing it keeps in memory, so an
operator restart starts its bound again. Any run may be cut short (a crash, a restart) and the
next one picks up from whatever exists: children have deterministic names and owner
references, so nothing is duplicated or orphaned.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from dynamo_operator.api.autoscaling import AutoscalingStatus
from dynamo_operator.api.common import Condition
from dynamo_operator.api.conditions import merge_conditions
from dynamo_operator.api.conditions import now as utc_now
from dynamo_operator.api.dynamoworker import DECODE, PREFILL, DynamoWorker, DynamoWorkerStatus
from dynamo_operator.api.metadata import DynamoWorkerMetadata
from dynamo_operator.k8s import kinds
from dynamo_operator.k8s.client import ApiError, Cluster
from dynamo_operator.pods.taints import TaintPusher
from dynamo_operator.reconcile.children import ChildIndex, ChildReader
from dynamo_operator.reconcile.converge import difference, needs_apply, stamped
from dynamo_operator.reconcile.dynamoworker.activator import activator_ready, wants_activator
from dynamo_operator.reconcile.dynamoworker.adapter_gate import RequiredAdapter, wanted_condition
from dynamo_operator.reconcile.dynamoworker.builders import POD_MONITOR_CRD, desired_children
from dynamo_operator.reconcile.dynamoworker.disaggregation import roles
from dynamo_operator.reconcile.dynamoworker.handover import (
    HAND_OVER_TIMEOUT_SECONDS,
    HandOver,
    hand_over,
)
from dynamo_operator.reconcile.dynamoworker.kv_transfer import KvTransferView
from dynamo_operator.reconcile.dynamoworker.labels import (
    activator_name,
    deployment_name,
    fill_job_name,
    frontend_name,
    model_cache_claim_name,
    network_policy_name,
    pod_monitor_name,
)
from dynamo_operator.reconcile.dynamoworker.manifests import identity, wants_pod_monitor
from dynamo_operator.reconcile.dynamoworker.model_cache import (
    CACHE_CONTAINER,
    JOB_NAME_LABEL,
    PROGRESS_POLL_SECONDS,
    CachePhase,
    CacheState,
    attempt_of,
    cache_key,
    cache_state,
    desired_claim,
    desired_fill_job,
    desired_prune_job,
    is_complete,
    progress_pod,
    rolled_out,
    stale_key,
)
from dynamo_operator.reconcile.dynamoworker.pod_summary import PodSummary
from dynamo_operator.reconcile.dynamoworker.settings import ReconcileSettings
from dynamo_operator.reconcile.dynamoworker.status import (
    WorkerObservation,
    compute_status,
    status_hold_seconds,
)
from dynamo_operator.reconcile.dynamoworker.transitions import note, transitions
from dynamo_operator.reconcile.errors import SpecError, TransientError
from dynamo_operator.reconcile.events import EventRecorder, Regarding
from dynamo_operator.reconcile.status_writer import StatusWriter

logger = logging.getLogger(__name__)

CRD_CHECK_INTERVAL_SECONDS = 60.0
# Lines of a fill pod's log read for its progress (the last progress line is among them).
PROGRESS_LINES = 3
# How often a cache whose volume is unavailable is looked at again (its claim's changes wake
# the worker too, when the operator made it).
VOLUME_POLL_SECONDS = 30.0
# The kinds of the activator's children, in deletion order.
ACTIVATOR_KINDS = (
    kinds.DEPLOYMENT,
    kinds.ENDPOINT_SLICE,
    kinds.NETWORK_POLICY,
    kinds.ROLE_BINDING,
    kinds.ROLE,
    kinds.SERVICE_ACCOUNT,
)
# The kinds of the prefill pods' children (spec.prefill), in deletion order: the pods first.
PREFILL_KINDS = (
    kinds.DEPLOYMENT,
    kinds.POD_DISRUPTION_BUDGET,
    kinds.SERVICE,
    kinds.NETWORK_POLICY,
)
# The kinds of the frontend's children, in deletion order (see `desired_frontend_children`).
FRONTEND_KINDS = (
    kinds.DEPLOYMENT,
    kinds.SERVICE,
    kinds.ROLE_BINDING,
    kinds.ROLE,
    kinds.SERVICE_ACCOUNT,
)


@dataclass(frozen=True)
class Outcome:
    """What one reconcile did and saw."""

    status: dict[str, Any]
    applied: tuple[str, ...] = ()
    status_written: bool = False
    spec_error: str | None = None
    # Run again this soon (a status held back, see `status_hold_seconds`); None: no need.
    wake_in_seconds: float | None = None


@dataclass(frozen=True)
class _ChildResult:
    """One child after its step: the live object (None: absent), whether it was applied, and
    the API server's refusal, if any."""

    live: dict[str, Any] | None
    applied: bool = False
    error: ApiError | None = None


def _spec_error_text(err: ValidationError) -> str:
    parts = []
    for item in err.errors()[:5]:
        where = ".".join(str(p) for p in item["loc"])
        parts.append(f"{where}: {item['msg']}" if where else str(item["msg"]))
    return "the spec is invalid: " + "; ".join(parts)


def _cache_wake(cache: CacheState | None, now: datetime) -> float | None:
    """When to look at the model cache's fill again: soon while it runs (its progress), at the
    retry time when it failed."""
    if cache is None or cache.ready:
        return None
    if cache.retry_at is not None:
        return max(1.0, (cache.retry_at - now).total_seconds())
    if cache.phase is CachePhase.VOLUME_UNAVAILABLE:
        return VOLUME_POLL_SECONDS  # someone has to fix the claim: no hurry
    return PROGRESS_POLL_SECONDS


def _owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


@dataclass
class WorkerReconciler:
    """Reconciles DynamoWorkers; one instance per operator, shared by all objects.

    `settings` holds the operator's defaults; whether the PodMonitor CRD exists is re-checked
    at most every `CRD_CHECK_INTERVAL_SECONDS`. `taints` may be None (no pushes).
    `autoscaling(namespace, name)` is the autoscaler's view for status.autoscaling, and
    `kv_transfer(namespace, name)` the KV-transfer monitor's per role (None: keep what status
    shows).
    """

    cluster: Cluster
    settings: ReconcileSettings
    taints: TaintPusher | None = None
    reporting_instance: str = "dynamo-operator"
    clock: Callable[[], datetime] = utc_now
    autoscaling: Callable[[str, str], AutoscalingStatus | None] = lambda namespace, name: None
    kv_transfer: Callable[[str, str], KvTransferView | None] = lambda namespace, name: None
    _crd_checked_at: float = field(default=float("-inf"), init=False)
    # Per DynamoWorker uid: when its hand-over to the activator began (see `handover`).
    _hand_over_since: dict[str, datetime] = field(default_factory=dict, init=False)
    _status: StatusWriter = field(init=False)
    _events: EventRecorder = field(init=False)
    children: ChildReader = field(init=False)

    def __post_init__(self) -> None:
        self._status = StatusWriter(self.cluster, kinds.DYNAMO_WORKER, DynamoWorkerStatus)
        self.children = ChildReader(self.cluster)
        self._events = EventRecorder(self.cluster, self.reporting_instance)

    async def refresh_cluster_facts(self) -> ReconcileSettings:
        """The settings, with the PodMonitor CRD's presence re-checked when it is due."""
        now = time.monotonic()
        if now - self._crd_checked_at >= CRD_CHECK_INTERVAL_SECONDS:
            # Marked before the request: reconciles running meanwhile keep the last answer
            # instead of each sending the same check (up to 16 of them at once).
            previous, self._crd_checked_at = self._crd_checked_at, now
            try:
                present = await self.cluster.crd_exists(POD_MONITOR_CRD)
            except ApiError:
                self._crd_checked_at = previous  # the next reconcile asks again
                raise
            if present != self.settings.pod_monitor_crd:
                logger.info("PodMonitor CRD %s", "found" if present else "not found")
                self.settings = replace(self.settings, pod_monitor_crd=present)
        return self.settings

    def is_echo(self, meta: Mapping[str, Any]) -> bool:
        """Whether the DynamoWorker at `meta` is just what our last status write made of it
        (its watch event needs no reconcile)."""
        return self._status.is_echo(meta)

    def forget(self, namespace: str, name: str, uid: str) -> None:
        """Drop what is remembered about a deleted object."""
        self._status.forget(uid)
        self._hand_over_since.pop(uid, None)
        if self.taints is not None:
            self.taints.forget(namespace, name)

    async def reconcile(
        self,
        body: Mapping[str, Any],
        pods: Sequence[PodSummary] = (),
        metadata: Mapping[str, DynamoWorkerMetadata] | None = None,
        *,
        required: Sequence[RequiredAdapter] = (),
        index: ChildIndex | None = None,
    ) -> Outcome:
        """One reconcile of the DynamoWorker `body` (as the watch delivers it), given its pods
        and their DynamoWorkerMetadata. Raises TransientError when it should be retried.

        `index` holds the children the watches report (see `reconcile.children`): they are
        read from it, so a pass over a converged worker sends no request at all; without
        it (or for a kind it does not watch) they are read from the API server.

        `required` are the LoRAAdapters with requiredForReadiness that target this worker:
        while there are any, its pods carry the adapters' readiness gate, set per pod here.
        """
        metadata = metadata or {}
        meta = body.get("metadata") or {}
        raw_status = self._status.current(meta, body.get("status"))
        try:
            dw = DynamoWorker.model_validate({**body, "status": raw_status})
        except ValidationError as err:
            return await self._invalid(meta, raw_status, _spec_error_text(err))
        settings = await self._settings()
        if not dw.spec.lora.enabled:
            # No adapter can load on these pods (the adapters' status says so); a gate would
            # only keep them from ever serving.
            required = ()
        try:
            cache = await self._model_cache(dw, settings, index)
            hold = cache is not None and not cache.ready
            hand_over_state, hand_over_wake = (
                (HandOver.NONE, None) if hold else await self._hand_over(dw, meta, index)
            )
            children = desired_children(
                dw,
                settings,
                adapters_gate=bool(required),
                hold_deployment=hold,
                hold_last_pod=hand_over_state is HandOver.WAITING,
            )
            desired = [stamped(m) for m in children]
        except SpecError as err:
            return await self._write_status(
                dw,
                meta,
                raw_status,
                WorkerObservation(
                    now=self.clock(), pods=pods, metadata=metadata, spec_error=str(err)
                ),
                spec_error=str(err),
            )

        # Read every child at once; write in order (identity and permissions before the pods
        # that use them), so a run cut short leaves a prefix of the children applied.
        lives = await asyncio.gather(*(self._read(m, index) for m in desired))
        results = [await self._converge(m, live) for m, live in zip(desired, lives, strict=True)]
        child_errors: list[str] = []
        applied: list[str] = []
        transient: list[str] = []
        deployments: dict[str, dict[str, Any] | None] = {}
        for manifest, result in zip(desired, results, strict=True):
            what = f"{manifest['kind']} {manifest['metadata']['name']}"
            if result.error is not None:
                (transient if result.error.retryable else child_errors).append(
                    f"{what}: {result.error.message}"
                )
            if result.applied:
                applied.append(what)
            if manifest["kind"] == "Deployment":
                deployments[manifest["metadata"]["name"]] = result.live
        await self._remove_unwanted(dw, settings, desired, index)
        worker = dw.metadata.name or ""
        if hold:
            # Held while the cache fills: not applied, but their state is still the status's.
            for role in roles(dw.spec):
                held = deployment_name(worker, role)
                deployments[held] = await self.children.live(
                    index, kinds.DEPLOYMENT, dw.metadata.namespace or "", held
                )

        await self._sync_gates(dw, pods, required, transient)
        failures: dict[str, str] = {}
        if self.taints is not None and dw.metadata.namespace and dw.metadata.name:
            failures = self.taints.sync(
                dw.metadata.namespace, dw.metadata.name, dw.spec.model_taints, pods, metadata
            )
        if cache is not None and cache.ready:
            cache = await self._prune(dw, settings, cache, deployments, index)
        observed = WorkerObservation(
            now=self.clock(),
            deployment=deployments.get(deployment_name(worker)),
            prefill_deployment=deployments.get(deployment_name(worker, PREFILL)),
            frontend_deployment=deployments.get(frontend_name(worker)),
            pods=pods,
            metadata=metadata,
            child_errors=child_errors,
            taint_failures=failures,
            pod_monitor_unavailable=(
                wants_pod_monitor(dw.spec, settings) and not settings.pod_monitor_crd
            ),
            model_cache=cache,
            autoscaling=self._autoscaling_view(dw),
            kv_transfer=self._kv_transfer_view(dw),
            hand_over=hand_over_state,
        )
        outcome = await self._write_status(dw, meta, raw_status, observed, applied=applied)
        if transient:
            raise TransientError("; ".join(transient))
        for wake in (_cache_wake(cache, self.clock()), hand_over_wake):
            if wake is not None and (
                outcome.wake_in_seconds is None or wake < outcome.wake_in_seconds
            ):
                outcome = replace(outcome, wake_in_seconds=wake)
        return outcome

    async def _hand_over(
        self, dw: DynamoWorker, meta: Mapping[str, Any], index: ChildIndex | None
    ) -> tuple[HandOver, float | None]:
        """Where the hand-over to the activator stands (see `handover`), and when to look
        again while it waits: at its bound (the activator's slice waking the worker ends it
        sooner). A hand-over that times out is a Warning Event."""
        worker, namespace, uid = identity(dw)
        deployment = await self._read_child(
            kinds.DEPLOYMENT, namespace, deployment_name(worker), index
        )
        slice_ = await self._read_child(
            kinds.ENDPOINT_SLICE, namespace, activator_name(worker), index
        )
        now = self.clock()
        waited = (now - self._hand_over_since.setdefault(uid, now)).total_seconds()
        state = hand_over(
            desired=dw.spec.replicas,
            has_activator=wants_activator(dw),
            deployment_replicas=int(((deployment or {}).get("spec") or {}).get("replicas", 0)),
            activator_ready=activator_ready(slice_),
            waited_seconds=waited,
        )
        if state is HandOver.NONE:
            del self._hand_over_since[uid]
        elif state is HandOver.WAITING:
            return state, max(1.0, HAND_OVER_TIMEOUT_SECONDS - waited)
        elif state is HandOver.DONE:
            logger.info(
                "DynamoWorker %s/%s: the activator stands in; the last pod goes", namespace, worker
            )
        else:
            note = (
                f"the activator was not ready {waited:.0f} s after spec.replicas became 0: the "
                f"last pod goes anyway, and requests get 503 until the activator stands in "
                f"(kubectl logs deploy/{activator_name(worker)})"
            )
            logger.warning("DynamoWorker %s/%s: %s", namespace, worker, note)
            await self._events.record(
                Regarding.of(kinds.DYNAMO_WORKER, meta),
                reason="HandOverTimedOut",
                note=note,
                action="Scale",
                warning=True,
            )
        return state, None

    def _autoscaling_view(self, dw: DynamoWorker) -> AutoscalingStatus | None:
        """The autoscaler's latest view, else what status shows (a new leader's autoscaler
        has not read the pods yet)."""
        view = self.autoscaling(dw.metadata.namespace or "", dw.metadata.name or "")
        if view is None and dw.status is not None:
            return dw.status.autoscaling
        return view

    def _kv_transfer_view(self, dw: DynamoWorker) -> KvTransferView | None:
        """The KV-transfer monitor's latest view, else what status shows (a new leader's
        monitor has not read the pods yet)."""
        view = self.kv_transfer(dw.metadata.namespace or "", dw.metadata.name or "")
        status = dw.status
        if view is not None or status is None:
            return view
        shown = {DECODE: status.kv_transfer}
        if status.prefill is not None:
            shown[PREFILL] = status.prefill.kv_transfer
        return {role: s for role, s in shown.items() if s is not None}

    async def _model_cache(
        self, dw: DynamoWorker, settings: ReconcileSettings, index: ChildIndex | None
    ) -> CacheState | None:
        """Make sure the current source's fill has what it needs (the claim, when the
        operator owns it, and the fill Job, replaced once its retry delay is over), and say
        where it stands. None without spec.model.cache."""
        cache = dw.spec.model.cache
        if cache is None:
            return None
        worker, namespace, _ = identity(dw)
        claim_manifest = desired_claim(dw)
        if claim_manifest is not None:
            claim = await self._converge_child(stamped(claim_manifest), index)
        else:
            # The user's claim carries none of our labels, so no watch holds it.
            claim = await self._get(
                kinds.PERSISTENT_VOLUME_CLAIM,
                namespace,
                model_cache_claim_name(worker, cache.claim_name),
            )
        key = cache_key(dw.spec.model.source)
        job_name = fill_job_name(worker, key)
        job = await self._read_child(kinds.JOB, namespace, job_name, index)
        if job is None and claim is not None:
            job = await self._converge_child(stamped(desired_fill_job(dw, settings, 1)), index)
        reported = dw.status.model_cache if dw.status is not None else None
        if reported is not None and reported.key != key:
            reported = None
        pods: list[dict[str, Any]] = []
        log_tail = None
        # The fill pods are read while the Job runs, and once after it succeeds for the total.
        if job is not None and (
            not is_complete(job) or reported is None or reported.bytes_total is None
        ):
            pods = await self._get_list(kinds.POD, namespace, f"{JOB_NAME_LABEL}={job_name}")
            logged = progress_pod(pods)
            if logged is not None:
                log_tail = await self._log_tail(namespace, logged)
        now = self.clock()
        state = cache_state(dw, claim=claim, job=job, fill_pods=pods, log_tail=log_tail, now=now)
        if state.ready and state.bytes_total is None and reported is not None:
            state = replace(state, bytes_done=reported.bytes_done, bytes_total=reported.bytes_total)
        state = replace(state, stale_key=stale_key(dw))
        if job is not None and state.retry_at is not None and state.retry_at <= now:
            # Replace the failed Job (its pods go with it), counting the attempt on.
            await self._delete_job(namespace, job)
            retry = stamped(desired_fill_job(dw, settings, attempt_of(job) + 1))
            job = await self._converge_child(retry, index)
            state = replace(cache_state(dw, claim=claim, job=job, now=now), stale_key=stale_key(dw))
        return state

    async def _prune(
        self,
        dw: DynamoWorker,
        settings: ReconcileSettings,
        cache: CacheState,
        deployments: Mapping[str, dict[str, Any] | None],
        index: ChildIndex | None,
    ) -> CacheState:
        """Remove an earlier source's directory from the operator's claim (a prune Job) once
        every pod runs the current source; `cache` with the stale key it still awaits."""
        worker, namespace, _ = identity(dw)
        if cache.stale_key is None or not rolled_out(dw, deployments.get(deployment_name(worker))):
            return cache
        try:
            job = await self._converge_child(stamped(desired_prune_job(dw, settings)), index)
        except SpecError as err:  # the pods serve meanwhile: a leftover directory can wait
            logger.warning("DynamoWorker %s/%s: cannot prune the cache: %s", namespace, worker, err)
            return cache
        if job is None or not is_complete(job):
            return cache
        # Done: the Job goes too, so that a later change back to this source prunes again.
        await self._delete_job(namespace, job)
        return replace(cache, stale_key=None)

    async def _delete_job(self, namespace: str, job: Mapping[str, Any]) -> None:
        """Delete a Job of the model cache (its pods go with it)."""
        name = job["metadata"]["name"]
        try:
            await self.cluster.delete(kinds.JOB, namespace, name, job["metadata"]["uid"])
        except ApiError as err:
            raise TransientError(str(err)) from err
        self.children.wrote(kinds.JOB, namespace, name, None)

    async def _read_child(
        self, kind: kinds.Kind, namespace: str, name: str, index: ChildIndex | None
    ) -> dict[str, Any] | None:
        try:
            return await self.children.live(index, kind, namespace, name)
        except ApiError as err:
            raise TransientError(str(err)) from err

    async def _converge_child(
        self, manifest: dict[str, Any], index: ChildIndex | None
    ) -> dict[str, Any] | None:
        """Apply one child if its live copy differs; the live object after it."""
        meta = manifest["metadata"]
        live = await self._read_child(
            kinds.kind_of(manifest), meta["namespace"], meta["name"], index
        )
        result = await self._converge(manifest, live)
        if result.error is not None:
            if result.error.retryable:
                raise TransientError(str(result.error))
            raise SpecError(f"{manifest['kind']} {meta['name']}: {result.error.message}")
        return result.live

    async def _get(self, kind: kinds.Kind, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.cluster.get(kind, namespace, name)
        except ApiError as err:
            raise TransientError(str(err)) from err

    async def _get_list(
        self, kind: kinds.Kind, namespace: str, selector: str
    ) -> list[dict[str, Any]]:
        try:
            return await self.cluster.list(kind, namespace, selector)
        except ApiError as err:
            raise TransientError(str(err)) from err

    async def _log_tail(self, namespace: str, pod: str) -> str | None:
        """The fill's last lines; None when they cannot be read (progress is only a nicety)."""
        try:
            return await self.cluster.pod_log_tail(namespace, pod, CACHE_CONTAINER, PROGRESS_LINES)
        except ApiError as err:
            logger.debug("cannot read the log of fill pod %s/%s: %s", namespace, pod, err)
            return None

    async def _settings(self) -> ReconcileSettings:
        try:
            return await self.refresh_cluster_facts()
        except ApiError as err:
            if err.retryable:
                raise TransientError(str(err)) from err
            return self.settings  # e.g. no permission to read CRDs: keep the last answer

    async def _read(
        self, manifest: dict[str, Any], index: ChildIndex | None
    ) -> dict[str, Any] | ApiError | None:
        meta = manifest["metadata"]
        try:
            return await self.children.live(
                index, kinds.kind_of(manifest), meta["namespace"], meta["name"]
            )
        except ApiError as err:
            return err

    async def _converge(
        self, manifest: dict[str, Any], live: dict[str, Any] | ApiError | None
    ) -> _ChildResult:
        if isinstance(live, ApiError):
            return _ChildResult(None, error=live)
        if not needs_apply(manifest, live):
            return _ChildResult(live)
        name = manifest["metadata"]["name"]
        if live is not None:
            logger.debug("%s %s differs at %s", manifest["kind"], name, difference(manifest, live))
        try:
            result = await self.cluster.apply(manifest)
        except ApiError as err:
            return _ChildResult(live, error=err)
        namespace = manifest["metadata"]["namespace"]
        self.children.wrote(kinds.kind_of(manifest), namespace, name, result)
        return _ChildResult(result, applied=True)

    async def _sync_gates(
        self,
        dw: DynamoWorker,
        pods: Sequence[PodSummary],
        required: Sequence[RequiredAdapter],
        transient: list[str],
    ) -> None:
        """Set the LoRA-adapters gate condition on each gated pod whose condition lags."""
        namespace = dw.metadata.namespace or ""
        for pod in pods:
            condition = wanted_condition(pod, required, self.clock())
            if condition is None:
                continue
            try:
                await self.cluster.patch_pod_conditions(namespace, pod.name, [condition])
            except ApiError as err:
                if err.status != 404:  # a pod deleted meanwhile needs nothing
                    transient.append(f"Pod {pod.name} readiness gate: {err.message}")

    async def _remove_unwanted(
        self,
        dw: DynamoWorker,
        settings: ReconcileSettings,
        desired: Sequence[dict[str, Any]],
        index: ChildIndex | None,
    ) -> None:
        """Delete children this worker owns and no longer wants (not in `desired`): its
        NetworkPolicy when spec.networkPolicy is disabled, its
        PodMonitors when spec.metrics stops asking for them, the frontend's children when
        spec.frontend goes, the prefill pods' children when spec.prefill goes, the
        activator's when the worker may no longer scale to zero, the
        model cache's claim when spec.model.cache stops asking for it,
        and the fill Job of the source status last reported once it is not the current one.
        Only what may exist is read: PodMonitors when their CRD exists, the frontend's
        children when status.frontend says they were made (it stays until these deletes are
        done), the prefill pods' when status.prefill says so (the same way), the claim and
        that Job when status.modelCache says so."""
        name, namespace, uid = dw.metadata.name, dw.metadata.namespace, dw.metadata.uid
        if not (name and namespace and uid):
            return
        candidates: list[tuple[kinds.Kind, str]] = [
            (kinds.NETWORK_POLICY, network_policy_name(name))
        ]
        # The activator's, once the worker may no longer scale to zero (all watched kinds:
        # looking costs no request). Pods first, as for the frontend.
        candidates += [(kind, activator_name(name)) for kind in ACTIVATOR_KINDS]
        monitors = settings.pod_monitor_crd
        if monitors:
            candidates.append((kinds.POD_MONITOR, pod_monitor_name(name)))
        if dw.status is not None and dw.status.frontend is not None:
            # Pods first: the Deployment goes before the identity its pods use.
            kinds_ = (kinds.POD_MONITOR, *FRONTEND_KINDS) if monitors else FRONTEND_KINDS
            candidates += [(kind, frontend_name(name)) for kind in kinds_]
        if dw.status is not None and dw.status.prefill is not None:
            # Each named `<name>-prefill`, as the Deployment is.
            prefill_kinds = (*PREFILL_KINDS, kinds.POD_MONITOR) if monitors else PREFILL_KINDS
            candidates += [(kind, deployment_name(name, PREFILL)) for kind in prefill_kinds]
        reported = dw.status.model_cache if dw.status is not None else None
        if reported is not None:
            # The claim the operator made for spec.model.cache, once the spec no longer asks
            # for one (its pods keep it until they are gone: the API server protects a claim
            # in use), and the fill Job of a source no longer wanted, done or not.
            candidates.append((kinds.PERSISTENT_VOLUME_CLAIM, model_cache_claim_name(name)))
            candidates.append((kinds.JOB, fill_job_name(name, reported.key)))
        cache = dw.spec.model.cache
        wanted = {(m["kind"], m["metadata"]["name"]) for m in desired}
        if cache is not None:
            wanted.add((kinds.JOB.kind, fill_job_name(name, cache_key(dw.spec.model.source))))
            if cache.claim_name is None:
                wanted.add((kinds.PERSISTENT_VOLUME_CLAIM.kind, model_cache_claim_name(name)))
        for kind, child in candidates:
            if (kind.kind, child) in wanted:
                continue
            live = await self.children.live(index, kind, namespace, child)
            if live is not None and _owned_by(live, uid):
                await self.cluster.delete(kind, namespace, child, live["metadata"]["uid"])
                self.children.wrote(kind, namespace, child, None)

    async def _invalid(
        self, meta: Mapping[str, Any], raw_status: Mapping[str, Any], message: str
    ) -> Outcome:
        """Status for an object the models refuse (an API/operator version skew)."""
        existing = self._status.normalized(raw_status)
        generation = int(meta.get("generation") or 0)
        now = self.clock()
        status = DynamoWorkerStatus.model_validate(existing)
        wanted = [
            Condition(
                type=t,
                status=s,
                reason="InvalidSpec",
                message=message,
                observed_generation=generation,
                last_transition_time=now,
            )
            for t, s in (("Ready", "False"), ("Progressing", "False"), ("Degraded", "True"))
        ]
        status.conditions = merge_conditions(status.conditions, wanted)
        status.observed_generation = generation
        new = status.to_dict()
        written = await self._status.write(meta, existing, new)
        return Outcome(status=new, status_written=written, spec_error=message)

    async def _write_status(
        self,
        dw: DynamoWorker,
        meta: Mapping[str, Any],
        raw_status: Mapping[str, Any],
        observed: WorkerObservation,
        *,
        applied: Sequence[str] = (),
        spec_error: str | None = None,
    ) -> Outcome:
        existing = self._status.normalized(raw_status)
        new = compute_status(dw, observed)
        hold = status_hold_seconds(existing, new, self._status.held(meta))
        if hold > 0:
            self._status.hold(meta)
            return Outcome(
                status=new, applied=tuple(applied), spec_error=spec_error, wake_in_seconds=hold
            )
        written = await self._status.write(meta, existing, new)
        if written:
            old_conditions = dw.status.conditions if dw.status is not None else []
            new_conditions = DynamoWorkerStatus.model_validate(new).conditions
            await self._record_events(meta, old_conditions, new_conditions)
        return Outcome(
            status=new, applied=tuple(applied), status_written=written, spec_error=spec_error
        )

    async def _record_events(
        self,
        meta: Mapping[str, Any],
        old: Sequence[Condition],
        new: Sequence[Condition],
    ) -> None:
        """One Event for the transitions of one status write: they are one occurrence (a
        worker's pods turning ready both complete its rollout and make it Ready). It takes
        the reason of the first Warning among them, else of the first; its note names each."""
        changed = transitions(old, new)
        if not changed:
            return
        warnings = [c for c, event_type in changed if event_type == "Warning"]
        lead = warnings[0] if warnings else changed[0][0]
        await self._events.record(
            Regarding.of(kinds.DYNAMO_WORKER, meta),
            reason=lead.reason,
            note="; ".join(note(c) for c in [lead, *(c for c, _ in changed if c is not lead)]),
            action="Reconcile",
            warning=bool(warnings),
        )
