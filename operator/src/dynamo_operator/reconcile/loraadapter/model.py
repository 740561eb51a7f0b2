"""What the LoRAAdapter planner reads and remembers (pure records).

Observations: a worker `Pod`, its `Listing` (`GET /v1/loras`, from `pods.adapters`), the
requests `InFlight`; what the operator remembers per pod, a `PodTrack`; what the spec wants,
`Desired`; the requests the plan starts, `Action`s; the retry policy, `Backoff`. All of it
together is one `AdapterObservation`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from dynamo_operator.api.dynamoworker import WorkerRole
from dynamo_operator.api.loraadapter import AdapterPodStatus, AdapterState, LoRAAdapter
from dynamo_operator.pods.adapters import Listing
from dynamo_operator.reconcile.dynamoworker.pod_summary import PodSummary
from dynamo_operator.reconcile.loraadapter.targeting import WorkerInfo

Op = Literal["load", "unload"]


@dataclass(frozen=True)
class Pod:
    """A worker pod: identity, address, readiness and role (prefill or decode, for a
    disaggregated worker's pod: adapters load onto both)."""

    name: str
    worker: str
    ip: str | None
    ready: bool
    terminating: bool = False
    role: WorkerRole | None = None

    @property
    def eligible(self) -> bool:
        """Whether adapters may be loaded onto it now (ready, addressed, not shutting down)."""
        return self.ready and bool(self.ip) and not self.terminating

    @classmethod
    def of(cls, summary: PodSummary, worker: str) -> Pod:
        """A DynamoWorker's pod as its watch summary has it. Ready means its containers are
        ready, not the pod: a pod whose readiness waits for its required adapters (the
        readiness gate) must still get them."""
        return cls(
            name=summary.name,
            worker=worker,
            ip=summary.ip,
            ready=summary.containers_ready,
            terminating=summary.terminating,
            role=summary.role,
        )


@dataclass(frozen=True)
class InFlight:
    """A request to a pod that has not finished. `swap`: the pod served the name already."""

    op: Op
    uri: str | None = None
    sha256: str | None = None
    swap: bool = False


@dataclass(frozen=True)
class Action:
    """A request to make: load the current source onto a pod, or unload the adapter."""

    op: Op
    pod: str
    worker: str
    ip: str
    uri: str | None = None
    sha256: str | None = None
    swap: bool = False


@dataclass(frozen=True)
class PodTrack:
    """What the operator records about the adapter on one pod.

    `since` is when `state` last changed; a failure counts as a change (the pod went through
    Loading), so for a Failed pod it is when the last attempt failed, which the backoff
    counts from (`failed_at`). `verified`: a GET listed the adapter after the last
    successful load of `uri`.
    """

    pod: str
    worker: str
    state: AdapterState
    since: datetime
    uri: str | None = None
    sha256: str | None = None
    lora_id: int | None = None
    reason: str | None = None
    message: str | None = None
    attempts: int = 0
    failed_at: datetime | None = None
    verified: bool = False

    def to_status(self, role: WorkerRole | None = None) -> AdapterPodStatus:
        """The pod's status entry; `role`: the pod's, when it exists (a track holds none)."""
        return AdapterPodStatus(
            pod=self.pod,
            worker=self.worker,
            role=role,
            state=self.state,
            lora_id=self.lora_id,
            uri=self.uri,
            sha256=self.sha256,
            reason=self.reason,
            message=self.message,
            attempts=self.attempts,
            last_transition_time=self.since,
        )

    @classmethod
    def from_status(cls, status: AdapterPodStatus, now: datetime) -> PodTrack:
        """A track read back from status (after an operator restart)."""
        since = status.last_transition_time or now
        return cls(
            pod=status.pod,
            worker=status.worker or "",
            state=status.state,
            since=since,
            uri=status.uri,
            sha256=status.sha256,
            lora_id=status.lora_id,
            reason=status.reason,
            message=status.message,
            attempts=status.attempts,
            failed_at=since if status.state == AdapterState.FAILED else None,
            # A Loaded record was verified when it was written.
            verified=status.state == AdapterState.LOADED,
        )


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff per pod: base, 2 x base, 4 x base, ... up to `max_seconds`."""

    base_seconds: float = 2.0
    max_seconds: float = 300.0

    def delay(self, attempts: int) -> float:
        if attempts <= 0:
            return 0.0
        return float(min(self.max_seconds, self.base_seconds * 2 ** min(attempts - 1, 30)))

    def retry_at(self, track: PodTrack) -> datetime | None:
        """When a failed track may be retried; None when it has not failed."""
        if track.failed_at is None or track.attempts <= 0:
            return None
        return track.failed_at + timedelta(seconds=self.delay(track.attempts))


@dataclass(frozen=True)
class Desired:
    """The adapter as the spec wants it served."""

    name: str
    uri: str
    sha256: str | None

    def matches(self, track: PodTrack | None) -> bool:
        return track is not None and track.uri == self.uri and track.sha256 == self.sha256

    def served_by(self, listing: Listing) -> bool:
        """Whether the pod's listing names this very source as the one it serves."""
        return listing.sources.get(self.name) == (self.uri, self.sha256)

    @classmethod
    def of(cls, adapter: LoRAAdapter) -> Desired:
        return cls(
            name=adapter.adapter_name or "",
            uri=adapter.spec.source.uri,
            sha256=adapter.spec.source.sha256,
        )


@dataclass(frozen=True)
class AdapterObservation:
    """Everything one plan is computed from.

    `workers`: the targeted DynamoWorkers that exist. `missing_worker`: set when no worker
    matches (the message says which). `pods`: the pods of the targeted workers, and of any
    worker a track names (so pods that are no longer targeted can be unloaded). `listings`:
    `GET /v1/loras` answers by pod name (eligible pods only). `tracks`: what was recorded per
    pod. `conflict`: another LoRAAdapter that serves the same name on the same workers
    first (its name).
    """

    now: datetime
    workers: Sequence[WorkerInfo] = ()
    missing_worker: str | None = None
    pods: Sequence[Pod] = ()
    listings: Mapping[str, Listing] = field(default_factory=dict)
    in_flight: Mapping[str, InFlight] = field(default_factory=dict)
    tracks: Mapping[str, PodTrack] = field(default_factory=dict)
    conflict: str | None = None
