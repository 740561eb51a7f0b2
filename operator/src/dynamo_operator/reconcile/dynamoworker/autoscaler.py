"""The autoscaler's step for one DynamoWorker: read the load, decide, write the scale.

Runs in the leading operator replica only (kopf runs there only), every few seconds per
DynamoWorker with spec.autoscaling (`handlers.dynamoworker`'s autoscale daemon). One step:

1. reads the ready pods' load (and the activator's held requests) over their system port,
   through the shared `LoadReader` (bounded concurrency, timeouts);
2. asks the pure policy (`autoscale_policy.decide`) for a count;
3. when the count changes: before lowering it, sets each ready pod's
   `controller.kubernetes.io/pod-deletion-cost` to its requests in flight, so the ReplicaSet
   removes the least busy pods (the drain still completes what they serve); then
   merge-patches spec.replicas (the DynamoWorker's watch reconciles the Deployment) and
   records an Event with the decision's reason.

What status shows (`status.autoscaling`) is kept here, in memory, and written by the
reconciler (the one writer of status) when `on_change` wakes it: at once after a decision,
and at most every `STATUS_REFRESH_SECONDS` for a changed load, so an idle DynamoWorker costs
no API request at all and a busy one a status write a minute. A new leader starts from the
status the previous one left, and its policy waits a whole scale-down window before lowering
the count it finds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from dynamo_operator.api.autoscaling import Autoscaling, AutoscalingStatus, PodLoad, ScalingDecision
from dynamo_operator.api.conditions import now as utc_now
from dynamo_operator.k8s import kinds
from dynamo_operator.k8s.client import ApiError, Cluster
from dynamo_operator.metrics import OperatorMetrics
from dynamo_operator.pods.load import (
    ActivatorReading,
    Buckets,
    LoadReader,
    PodReading,
    ttft_p90,
)
from dynamo_operator.reconcile.dynamoworker.autoscale_policy import (
    Decision,
    LoadReading,
    PolicyState,
    decide,
)
from dynamo_operator.reconcile.dynamoworker.pod_summary import PodSummary
from dynamo_operator.reconcile.events import EventRecorder, Regarding

logger = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
STATUS_REFRESH_SECONDS = 60.0
EVENT_REASONS = {
    "Up": "ScaledUp",
    "Down": "ScaledDown",
    "ToZero": "ScaledToZero",
    "FromZero": "WokenFromZero",
    "Bounds": "ScaledToBounds",
}
Key = tuple[str, str]  # (namespace, name)


@dataclass
class _Tracked:
    """What the autoscaler keeps of one DynamoWorker between steps."""

    policy: PolicyState
    ttft: dict[str, Buckets] = field(default_factory=dict)  # per pod uid, at the last read
    view: AutoscalingStatus | None = None
    shown_at: datetime | None = None  # when `on_change` last woke the reconciler


def load_text(spec: Autoscaling, load: LoadReading) -> str:
    """The load against the first target set, as the Load printer column shows it."""
    pods = max(load.pods_read, 1)
    if spec.target_in_flight_per_pod is not None:
        per_pod = load.demand / pods
        return f"{per_pod:.2g}/{spec.target_in_flight_per_pod} in-flight per pod"
    if spec.target_kv_cache_percent is not None and load.kv_cache_percent is not None:
        return f"{load.kv_cache_percent / pods:.0f}/{spec.target_kv_cache_percent}% KV per pod"
    if spec.ttft_p90_milliseconds is not None and load.ttft_p90_seconds is not None:
        return f"{load.ttft_p90_seconds * 1000:.0f}/{spec.ttft_p90_milliseconds} ms TTFT p90"
    return f"{load.demand:g} in flight"


def _pod_load(load: LoadReading) -> PodLoad:
    pods = max(load.pods_read, 1)
    return PodLoad(
        in_flight_per_pod=f"{load.in_flight / pods:.3g}",
        kv_cache_percent=(
            None if load.kv_cache_percent is None else min(100, round(load.kv_cache_percent / pods))
        ),
        ttft_p90_milliseconds=(
            None if load.ttft_p90_seconds is None else round(load.ttft_p90_seconds * 1000)
        ),
        held_requests=load.held,
        pods_read=load.pods_read,
    )


@dataclass
class Autoscaler:
    """Steps DynamoWorkers with spec.autoscaling; one instance per operator."""

    cluster: Cluster
    reader: LoadReader
    events: EventRecorder
    metrics: OperatorMetrics | None = None
    on_change: Callable[[str, str], None] = lambda namespace, name: None
    clock: Callable[[], datetime] = utc_now
    _tracked: dict[Key, _Tracked] = field(default_factory=dict, init=False)

    def view(self, namespace: str, name: str) -> AutoscalingStatus | None:
        """What status.autoscaling should show (None: nothing read yet in this process)."""
        tracked = self._tracked.get((namespace, name))
        return None if tracked is None else tracked.view

    def forget(self, namespace: str, name: str) -> None:
        """Drop a DynamoWorker that is gone or no longer autoscaled."""
        self._tracked.pop((namespace, name), None)
        if self.metrics is not None:
            self.metrics.forget_autoscaler(namespace, name)

    async def read(
        self, tracked: _Tracked, pods: Sequence[PodSummary], activator_ip: str | None
    ) -> tuple[LoadReading, dict[str, PodReading]]:
        """One poll of the ready pods and the activator; the readings by pod name."""
        ready = [p for p in pods if p.ready and not p.terminating and p.ip]
        answers, activator = await asyncio.gather(
            asyncio.gather(*(self.reader.pod(p.ip or "") for p in ready)),
            self._activator(activator_ip),
        )
        readings = {p.name: r for p, r in zip(ready, answers, strict=True) if r is not None}
        buckets = {
            p.uid: r.ttft_buckets
            for p, r in zip(ready, answers, strict=True)
            if r is not None and r.ttft_buckets
        }
        p90 = ttft_p90(tracked.ttft, buckets) if tracked.ttft else None
        tracked.ttft = buckets
        kv = [r.kv_cache_percent for r in readings.values() if r.kv_cache_percent is not None]
        load = LoadReading(
            pods_read=len(readings),
            in_flight=sum(r.in_flight for r in readings.values()),
            kv_cache_percent=sum(kv) if kv else None,
            ttft_p90_seconds=p90,
            held=activator.held if activator is not None else 0,
            card_ready=activator is not None and activator.card_ready,
        )
        return load, readings

    async def _activator(self, ip: str | None) -> ActivatorReading | None:
        return None if ip is None else await self.reader.activator(ip)

    async def step(
        self,
        worker: Regarding,
        spec: Autoscaling,
        replicas: int,
        shown: AutoscalingStatus | None,
        pods: Sequence[PodSummary],
        activator_ip: str | None = None,
    ) -> Decision:
        """One poll of the DynamoWorker `worker` whose spec.replicas is `replicas` and whose
        status.autoscaling is `shown`. Raises ApiError when a write failed (the next step
        tries again)."""
        namespace, name = worker.namespace, worker.name
        now = self.clock()
        tracked = self._tracked.get((namespace, name))
        if tracked is None:
            # A new leader carries on from the status the previous one wrote; the policy
            # holds the current count for a whole scale-down window.
            tracked = self._tracked[(namespace, name)] = _Tracked(PolicyState(), view=shown)
        load, readings = await self.read(tracked, pods, activator_ip)
        decision, tracked.policy = decide(spec, replicas, load, tracked.policy, now.timestamp())
        self._export(namespace, name, load, decision.replicas)
        last = tracked.view.last_decision if tracked.view is not None else None
        if decision.direction is not None:
            await self._scale(worker, replicas, decision, pods, readings)
            last = ScalingDecision(
                time=now,
                from_replicas=replicas,
                to_replicas=decision.replicas,
                direction=decision.direction,
                reason=decision.reason[:1024],
            )
        view = AutoscalingStatus(
            desired_replicas=decision.replicas,
            load=load_text(spec, load),
            current=_pod_load(load),
            last_decision=last,
        )
        changed = view != tracked.view
        tracked.view = view
        due = tracked.shown_at is None or (
            (now - tracked.shown_at).total_seconds() >= STATUS_REFRESH_SECONDS
        )
        if decision.direction is not None or (changed and due):
            tracked.shown_at = now
            self.on_change(namespace, name)
        return decision

    async def _scale(
        self,
        worker: Regarding,
        replicas: int,
        decision: Decision,
        pods: Sequence[PodSummary],
        readings: Mapping[str, PodReading],
    ) -> None:
        namespace, name = worker.namespace, worker.name
        if 0 < decision.replicas < replicas:
            await self._set_deletion_costs(namespace, pods, readings)
        await self.cluster.patch(
            kinds.DYNAMO_WORKER, namespace, name, {"spec": {"replicas": decision.replicas}}
        )
        logger.info(
            "DynamoWorker %s/%s: %d -> %d replicas: %s",
            namespace,
            name,
            replicas,
            decision.replicas,
            decision.reason,
        )
        assert decision.direction is not None
        await self.events.record(
            worker,
            reason=EVENT_REASONS[decision.direction],
            note=f"{replicas} -> {decision.replicas} replicas: {decision.reason}",
            action="Scale",
        )

    async def _set_deletion_costs(
        self, namespace: str, pods: Sequence[PodSummary], readings: Mapping[str, PodReading]
    ) -> None:
        """Each pod's deletion cost = its requests in flight (a pod not read costs the most:
        it may be busy). The ReplicaSet removes the cheapest first."""
        busiest = max((r.in_flight for r in readings.values()), default=0.0)
        for pod in pods:
            if pod.terminating:
                continue
            reading = readings.get(pod.name)
            cost = round(reading.in_flight if reading is not None else busiest + 1)
            try:
                await self.cluster.patch(
                    kinds.POD,
                    namespace,
                    pod.name,
                    {"metadata": {"annotations": {DELETION_COST: str(cost)}}},
                )
            except ApiError as err:
                if err.status != 404:  # a pod gone meanwhile costs nothing
                    raise

    def _export(self, namespace: str, name: str, load: LoadReading, desired: int) -> None:
        if self.metrics is None:
            return
        gauge = self.metrics.autoscaler_load
        gauge.labels(namespace, name, "in_flight").set(load.in_flight)
        gauge.labels(namespace, name, "held").set(load.held)
        if load.kv_cache_percent is not None:
            gauge.labels(namespace, name, "kv_cache_percent").set(load.kv_cache_percent)
        if load.ttft_p90_seconds is not None:
            gauge.labels(namespace, name, "ttft_p90_seconds").set(load.ttft_p90_seconds)
        self.metrics.autoscaler_desired.labels(namespace, name).set(desired)
