"""Reconciling LoRAAdapters: observe the pods, run `plan.plan`, start requests, write status.

One `LoraReconciler` per operator. Per adapter (by uid) it keeps the pod tracks (seeded from
status after a restart), the requests in flight and when each pod started wanting the
current source (for the load-latency histogram). Loads run as background tasks, so a slow
download never holds up a reconcile; when one finishes, its result is folded into the pod's
track, an Event is recorded for a failure or an unload, and `on_change(namespace, name)`
asks the handlers for a prompt reconcile, which verifies the load with `GET /v1/loras`.

`finalize` unloads the adapter from every pod of its workers within a bounded time, for the
deletion finalizer: pods that are gone or do not answer in time are named in an Event and
never block the deletion.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from dynamo_operator.api.conditions import now as utc_now
from dynamo_operator.api.loraadapter import LoRAAdapter, LoRAAdapterStatus
from dynamo_operator.k8s import kinds
from dynamo_operator.k8s.client import Cluster
from dynamo_operator.metrics import OperatorMetrics
from dynamo_operator.pods.adapters import Listing, LoraClient, OpResult
from dynamo_operator.reconcile.events import EventRecorder, Regarding
from dynamo_operator.reconcile.loraadapter.model import (
    Action,
    AdapterObservation,
    Backoff,
    InFlight,
    Pod,
    PodTrack,
)
from dynamo_operator.reconcile.loraadapter.plan import Plan, plan, record_result
from dynamo_operator.reconcile.loraadapter.reasons import scrub
from dynamo_operator.reconcile.loraadapter.targeting import (
    AdapterRef,
    WorkerInfo,
    missing_worker_message,
    name_conflict,
    target_workers,
)
from dynamo_operator.reconcile.status_writer import StatusWriter

logger = logging.getLogger(__name__)
# How many reported deletions to remember (a handler re-run comes within seconds).
REPORTED_DELETIONS_KEPT = 1024


@dataclass(frozen=True)
class LoraOutcome:
    """What one reconcile saw and did. `wake_in_seconds`: when a backoff ends (None: no
    retry is waiting)."""

    status: dict[str, Any]
    status_written: bool = False
    actions: tuple[Action, ...] = ()
    wake_in_seconds: float | None = None


@dataclass(frozen=True)
class UnloadReport:
    """What deleting an adapter did on each pod."""

    unloaded: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()
    failed: Mapping[str, str] = field(default_factory=dict)
    skipped: str | None = None


@dataclass
class _Adapter:
    """What the reconciler remembers about one LoRAAdapter."""

    namespace: str
    name: str
    uid: str
    tracks: dict[str, PodTrack] = field(default_factory=dict)
    in_flight: dict[str, InFlight] = field(default_factory=dict)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    wanted_since: dict[str, float] = field(default_factory=dict)
    source: tuple[str, str | None] | None = None
    seeded: bool = False
    deleting: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def meta(self) -> dict[str, str]:
        return {"namespace": self.namespace, "name": self.name, "uid": self.uid}

    @property
    def regarding(self) -> Regarding:
        return Regarding(kinds.LORA_ADAPTER, self.namespace, self.name, self.uid)


PodsOf = Callable[[str], Sequence[Pod]]


@dataclass(frozen=True)
class NamespaceView:
    """What a LoRAAdapter's reconcile reads of its namespace (the handlers' indices): the
    DynamoWorkers, `pods_of(worker)` (that worker's pods), and the LoRAAdapters (for name
    clashes; the adapter itself may be among them)."""

    workers: Sequence[WorkerInfo]
    pods_of: PodsOf
    adapters: Sequence[AdapterRef] = ()


class LoraReconciler:
    """Reconciles LoRAAdapters (see the module doc)."""

    def __init__(
        self,
        cluster: Cluster,
        client: LoraClient,
        *,
        metrics: OperatorMetrics | None = None,
        backoff: Backoff | None = None,
        on_change: Callable[[str, str], None] = lambda namespace, name: None,
        reporting_instance: str = "dynamo-operator",
        unload_bound_seconds: float = 10.0,
        clock: Callable[[], datetime] = utc_now,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cluster = cluster
        self.client = client
        self.metrics = metrics
        self.backoff = backoff or Backoff()
        self.on_change = on_change
        self.unload_bound_seconds = unload_bound_seconds
        self.clock = clock
        self.monotonic = monotonic
        self._adapters: dict[str, _Adapter] = {}
        # Deletions already reported, by uid: kopf may run the deletion handler again (a
        # failed finalizer patch), and its Events must still be posted once per deletion.
        self._reported_deletions: OrderedDict[str, None] = OrderedDict()
        self._status = StatusWriter(cluster, kinds.LORA_ADAPTER, LoRAAdapterStatus)
        self._events = EventRecorder(cluster, reporting_instance)

    # --- reconcile ------------------------------------------------------------------------

    async def reconcile(
        self,
        body: Mapping[str, Any],
        view: NamespaceView,
    ) -> LoraOutcome:
        """One pass for the LoRAAdapter `body`, given what its namespace holds."""
        meta = body.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            # kopf signals the daemon to stop but lets a pass it already began run beside the
            # deletion handler, even after that handler unloaded the adapter and forgot it:
            # an adapter being deleted is never loaded again.
            return LoraOutcome(status=self._status.normalized(body.get("status")))
        state = self._state(meta)
        async with state.lock:
            if state.deleting:
                return LoraOutcome(status=self._status.normalized(body.get("status")))
            raw_status = self._status.current(meta, body.get("status"))
            adapter = LoRAAdapter.model_validate({**body, "status": raw_status})
            return await self._reconcile_locked(state, adapter, raw_status, view)

    async def _reconcile_locked(
        self,
        state: _Adapter,
        adapter: LoRAAdapter,
        raw_status: dict[str, Any],
        view: NamespaceView,
    ) -> LoraOutcome:
        now = self.clock()
        ref = AdapterRef.of(adapter)
        targeted = target_workers(ref, view.workers)
        if not state.seeded:
            statuses = adapter.status.pods if adapter.status is not None else []
            state.tracks = {s.pod: PodTrack.from_status(s, now) for s in statuses}
            state.seeded = True
        source = (adapter.spec.source.uri, adapter.spec.source.sha256)
        if state.source != source:
            state.source = source
            state.wanted_since.clear()  # every pod wants the new source from now on
        names = {w.name for w in targeted} | {t.worker for t in state.tracks.values() if t.worker}
        pods = [pod for worker in sorted(names) for pod in view.pods_of(worker)]
        listings = await self._list_all(state.namespace, [p for p in pods if p.eligible])
        if state.deleting:
            # The deletion began while this pass listed the pods, and has settled the
            # requests it found: a load started now would land after its unload.
            return LoraOutcome(status=self._status.normalized(raw_status))
        observed = AdapterObservation(
            now=now,
            workers=targeted,
            missing_worker=None if targeted else missing_worker_message(adapter),
            pods=pods,
            listings=listings,
            in_flight=dict(state.in_flight),
            tracks=dict(state.tracks),
            conflict=name_conflict(ref, view.adapters, view.workers),
        )
        decided = plan(adapter, observed, self.backoff)
        # From here on the tracks say what this pass saw, so the next plan will not report
        # these pods as newly loaded or lost again: the histogram and the Events for them
        # come now, before the status write, which may fail (and is retried from the tracks).
        state.tracks = decided.tracks
        self._measure(state, decided, adapter)
        for action in decided.actions:
            self._start(state, adapter, action)
        await self._announce(state, decided, adapter)
        written = await self._status.write(state.meta, raw_status, decided.status)
        wake = None
        if decided.next_retry_at is not None:
            wake = max((decided.next_retry_at - self.clock()).total_seconds(), 0.0)
        return LoraOutcome(decided.status, written, decided.actions, wake)

    def _measure(self, state: _Adapter, decided: Plan, adapter: LoRAAdapter) -> None:
        """Load latency per pod: from when the pod started wanting the current source."""
        now = self.monotonic()
        for pod in decided.lost:
            state.wanted_since[pod] = now
        for pod in decided.targets:
            state.wanted_since.setdefault(pod, now)
        for pod in decided.newly_loaded:
            since = state.wanted_since.pop(pod, None)
            if since is not None and self.metrics is not None:
                self.metrics.lora_load_duration.observe(now - since)
            logger.info(
                "LoRAAdapter %s/%s: pod %s serves %s",
                state.namespace,
                state.name,
                pod,
                adapter.adapter_name,
            )

    async def _announce(self, state: _Adapter, decided: Plan, adapter: LoRAAdapter) -> None:
        """The Events for the pods this pass found serving the adapter, or no longer."""
        for pod in decided.newly_loaded:
            track = decided.tracks[pod]
            await self._event(
                state,
                "Loaded",
                f"pod {pod} serves {adapter.adapter_name} from {track.uri} "
                f"(lora id {track.lora_id})",
            )
        for pod in decided.lost:
            await self._event(
                state,
                "Reloading",
                f"pod {pod} no longer lists {adapter.adapter_name} (its worker restarted?); "
                "loading it again",
            )

    async def _list_all(self, namespace: str, pods: Sequence[Pod]) -> dict[str, Listing]:
        answers = await asyncio.gather(*(self.client.list(p.ip or "") for p in pods))
        listings = {}
        for pod, listing in zip(pods, answers, strict=True):
            listings[pod.name] = listing
            if listing.loras is not None and self.metrics is not None:
                self.metrics.lora_adapters.labels(namespace=namespace, pod=pod.name).set(
                    listing.count
                )
        return listings

    # --- requests -------------------------------------------------------------------------

    def _start(self, state: _Adapter, adapter: LoRAAdapter, action: Action) -> None:
        state.in_flight[action.pod] = InFlight(action.op, action.uri, action.sha256, action.swap)
        name = adapter.adapter_name or ""
        task = asyncio.create_task(self._run(state, name, action))
        state.tasks.add(task)
        task.add_done_callback(state.tasks.discard)
        verb = "hot-swapping" if action.swap else action.op + "ing"
        logger.info(
            "LoRAAdapter %s/%s: %s %s on pod %s%s",
            state.namespace,
            state.name,
            verb,
            name,
            action.pod,
            f" from {action.uri}" if action.uri else "",
        )

    async def _run(self, state: _Adapter, name: str, action: Action) -> None:
        try:
            if action.op == "load":
                result = await self.client.load(action.ip, name, action.uri or "", action.sha256)
            else:
                result = await self.client.unload(action.ip, name)
        except asyncio.CancelledError:
            state.in_flight.pop(action.pod, None)
            raise
        except Exception as exc:  # never leave the pod marked in flight
            logger.exception("LoRAAdapter %s/%s: request failed", state.namespace, state.name)
            result = OpResult(ok=False, reason="LoadFailed", message=type(exc).__name__)
        async with state.lock:
            state.in_flight.pop(action.pod, None)
            track = record_result(
                state.tracks.get(action.pod), action, result, self.clock(), self.backoff
            )
            if track is None:
                state.tracks.pop(action.pod, None)
            else:
                state.tracks[action.pod] = track
        await self._report(state, name, action, result, track)
        if not state.deleting:
            self.on_change(state.namespace, state.name)

    async def _report(
        self,
        state: _Adapter,
        name: str,
        action: Action,
        result: OpResult,
        track: PodTrack | None,
    ) -> None:
        where = f"LoRAAdapter {state.namespace}/{state.name}"
        if action.op == "unload":
            if track is None:
                await self._event(state, "Unloaded", f"pod {action.pod} no longer serves {name}")
            else:
                logger.warning(
                    "%s: unload from pod %s failed: %s", where, action.pod, track.message
                )
                await self._event(
                    state, "UnloadFailed", f"pod {action.pod}: {track.message}", warning=True
                )
            return
        if result.ok:
            return
        if self.metrics is not None:
            self.metrics.lora_load_failures.labels(reason=result.reason or "LoadFailed").inc()
        message = track.message if track is not None else scrub(result.message)
        logger.warning("%s: pod %s: %s: %s", where, action.pod, result.reason, message)
        await self._event(
            state, result.reason or "LoadFailed", f"pod {action.pod}: {message}", warning=True
        )

    # --- deletion -------------------------------------------------------------------------

    async def finalize(
        self,
        body: Mapping[str, Any],
        view: NamespaceView,
    ) -> UnloadReport:
        """Unload the adapter from every pod of its workers, within `unload_bound_seconds`;
        record an Event for what could not be unloaded. Never raises for pods."""
        meta = body.get("metadata") or {}
        if str(meta.get("uid", "")) in self._reported_deletions:
            # kopf ran this deletion's handler again (its finalizer not yet removed): the
            # first run unloaded what it could, and asking an unreachable pod again would
            # hold the deletion for a second bound.
            return UnloadReport(skipped="an earlier run of this deletion unloaded it")
        state = self._state(meta)
        state.deleting = True
        deadline = self.monotonic() + self.unload_bound_seconds
        try:
            adapter = LoRAAdapter.model_validate({**body, "status": None})
        except ValueError as err:
            logger.warning("LoRAAdapter %s/%s unreadable; nothing unloaded: %s", *_id(meta), err)
            self.forget(str(meta.get("uid", "")))
            return UnloadReport(skipped="the object could not be read")
        # Loads still running finish first (within half the bound), so none lands after the
        # unload; whatever still runs then is cancelled.
        await self._settle_tasks(state, self.unload_bound_seconds / 2)
        ref = AdapterRef.of(adapter)
        rival = name_conflict(ref, view.adapters, view.workers)
        if rival is not None:
            self.forget(state.uid)
            return UnloadReport(skipped=f"LoRAAdapter {rival} serves the name")
        names = {w.name for w in target_workers(ref, view.workers)}
        names |= {t.worker for t in state.tracks.values() if t.worker}
        # Terminating pods are going away with their adapters: nothing to unload there.
        pods = [p for w in sorted(names) for p in view.pods_of(w) if p.ip and not p.terminating]
        name = adapter.adapter_name or ""
        remaining = max(deadline - self.monotonic(), 0.5)
        results = await asyncio.gather(
            *(self.client.unload(p.ip or "", name, timeout_seconds=remaining) for p in pods)
        )
        report = _report(pods, results)
        await self._record_unloads(state, name, report)
        self.forget(state.uid)
        return report

    async def _settle_tasks(self, state: _Adapter, seconds: float) -> None:
        tasks = list(state.tasks)
        if not tasks:
            return
        _, running = await asyncio.wait(tasks, timeout=seconds)
        for task in running:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*running, return_exceptions=True)

    async def _record_unloads(self, state: _Adapter, name: str, report: UnloadReport) -> None:
        if state.uid in self._reported_deletions:
            return
        self._reported_deletions[state.uid] = None
        while len(self._reported_deletions) > REPORTED_DELETIONS_KEPT:
            self._reported_deletions.popitem(last=False)
        if report.unloaded:
            await self._event(
                state, "Unloaded", f"{name} unloaded from pods {', '.join(report.unloaded)}"
            )
        if report.failed:
            parts = [f"{pod} ({why})" for pod, why in sorted(report.failed.items())]
            note = (
                f"{name} could not be unloaded from pods {', '.join(parts)}; they may serve it "
                "until they restart. The LoRAAdapter is deleted anyway."
            )
            logger.warning("LoRAAdapter %s/%s: %s", state.namespace, state.name, note)
            await self._event(state, "UnloadIncomplete", note, warning=True)

    # --- bookkeeping ----------------------------------------------------------------------

    def _state(self, meta: Mapping[str, Any]) -> _Adapter:
        uid = str(meta.get("uid", ""))
        state = self._adapters.get(uid)
        if state is None:
            state = _Adapter(str(meta.get("namespace", "")), str(meta.get("name", "")), uid)
            self._adapters[uid] = state
        return state

    def forget(self, uid: str) -> None:
        """Drop what is remembered about an adapter (its requests are left to finish)."""
        self._adapters.pop(uid, None)
        self._status.forget(uid)

    def forget_pod(self, namespace: str, pod: str) -> None:
        """Drop the per-pod gauge of a pod that is gone."""
        if self.metrics is not None:
            with contextlib.suppress(KeyError):
                self.metrics.lora_adapters.remove(namespace, pod)

    async def wait_idle(self) -> None:
        """Until every request started so far has finished."""
        while True:
            tasks = [t for s in list(self._adapters.values()) for t in s.tasks]
            if not tasks:
                return
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        """Cancel requests still running."""
        tasks = [t for s in self._adapters.values() for t in s.tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _event(self, state: _Adapter, reason: str, note: str, warning: bool = False) -> None:
        await self._events.record(
            state.regarding,
            reason=reason,
            note=note,
            action="Unload" if reason.startswith("Unload") else "Load",
            warning=warning,
        )


def _id(meta: Mapping[str, Any]) -> tuple[str, str]:
    return str(meta.get("namespace", "")), str(meta.get("name", ""))


def _report(pods: Sequence[Pod], results: Sequence[OpResult]) -> UnloadReport:
    unloaded, absent, failed = [], [], {}
    for pod, result in zip(pods, results, strict=True):
        if result.ok:
            unloaded.append(pod.name)
        elif result.reason == "NotLoaded":
            absent.append(pod.name)
        else:
            failed[pod.name] = f"{result.reason}: {scrub(result.message, 200)}"
    return UnloadReport(tuple(unloaded), tuple(absent), failed)
