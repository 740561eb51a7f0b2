"""LoRAAdapter reconciling, the pure part: which pods load or unload the adapter, and the status.

Inputs are observations (the targeted DynamoWorkers, their pods, each ready pod's answer to
`GET /v1/loras`, the requests in flight) plus what the operator remembers per pod (a
`PodTrack`: the state it last recorded, the source it refers to, attempts and when the last
one failed). `plan()` turns them into actions and the status to write; `record_result()`
folds the answer of a finished request into a pod's track. No clock, no I/O: the caller
passes `now`.

Rules:
- Verify, do not assume. A pod is `Loaded` only when its `GET /v1/loras` lists the adapter
  and the operator's last successful load on that pod was of the current source. A pod
  that listed it before and lists it no more (its worker restarted) is loaded again at once.
- Placement: `AllReplicas` targets every ready pod of the targeted workers; `Count` keeps
  the pods already serving the name, then adds those with the fewest adapters, skipping
  pods that just answered CapacityExceeded, and unloads surplus pods.
- A new source rolls pod by pod: a pod already serving the name (an older or unknown
  version) is hot-swapped only when no other swap is in flight, so every pod that served
  the name keeps serving it; a swap that fails stops the rollout (the pod keeps serving the
  old version) until that pod's retry succeeds. Pods that do not serve the name yet (new,
  restarted) load the current source right away.
- Every failed request is retried after an exponential backoff per pod (`Backoff`), based
  on the failure time recorded in status (`lastTransitionTime` of the `Failed` state), so a
  restarted operator does not retry sooner either.
- Messages from workers are scrubbed of anything credential-shaped before they reach
  status or Events (credentials never leave the worker pods' environment anyway).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from dynamo_operator.api.common import ConditionType, LabelSelector
from dynamo_operator.api.conditions import WantedCondition, apply_conditions, name_list
from dynamo_operator.api.dynamoworker import MAX_STATUS_PODS
from dynamo_operator.api.loraadapter import (
    KIND,
    AdapterPodStatus,
    AdapterState,
    LoRAAdapter,
    LoRAAdapterStatus,
)
from dynamo_operator.reconcile.events import NOTE_MAX, REPORTING_CONTROLLER

Op = Literal["load", "unload"]

SOURCE_PINNED = "SourcePinned"
# How much of a worker's message status and Events keep.
WORKER_MESSAGE_MAX = 600
# How many pods a condition message names before it says "and N more".
NAMED_PODS = 3

# The worker's machine-readable `reason` values (dynamo.common.lora.errors, lora_host) and
# the CamelCase reasons status shows for them.
WORKER_REASONS: dict[str, str] = {
    "digest mismatch": "DigestMismatch",
    "bad digest": "InvalidDigest",
    "not found": "SourceNotFound",
    "auth": "AuthFailed",
    "bad uri": "InvalidSource",
    "invalid adapter": "InvalidAdapter",
    "unsafe source": "UnsafeSource",
    "timeout": "DownloadTimeout",
    "offline": "HubOffline",
    "download failed": "DownloadFailed",
    "capacity": "CapacityExceeded",
    "unavailable": "LoRADisabled",
    "engine": "EngineError",
    "bad request": "BadRequest",
    "not loaded": "NotLoaded",
}
CAPACITY_EXCEEDED = "CapacityExceeded"
WORKER_UNREACHABLE = "WorkerUnreachable"
LORA_DISABLED = "LoRADisabled"

# What the user does about each reason (`{worker}`: the DynamoWorker's name).
FIXES: dict[str, str] = {
    "CapacityExceeded": "the pod holds its maximum number of adapters; raise spec.lora.maxLoras "
    "on DynamoWorker {worker}, delete a LoRAAdapter it serves, or use spec.placement.policy: "
    "Count",
    "DigestMismatch": "the adapter files do not match spec.source.sha256; set sha256 to the "
    "digest of the intended files or point spec.source.uri at them",
    "InvalidDigest": "spec.source.sha256 must be 64 lowercase hexadecimal digits",
    "SourceNotFound": "nothing was found at spec.source.uri; check the bucket and prefix "
    "(s3://), the repository and revision (hf://) or the path (file://)",
    "AuthFailed": "the storage refused the worker's credentials; check the Secret that "
    "DynamoWorker {worker} references in spec.credentials (its keys and their access rights)",
    "InvalidSource": "spec.source.uri cannot be used as it is; fix its form",
    "InvalidAdapter": "the files at spec.source.uri are not a PEFT LoRA adapter "
    "(adapter_config.json and adapter weights are expected)",
    "UnsafeSource": "the source holds paths that leave the adapter directory, or too many "
    "files; fix the files at spec.source.uri",
    "DownloadTimeout": "the download took too long; check that the storage is reachable from "
    "the pods and not overloaded",
    "DownloadFailed": "check that the storage endpoint (spec.credentials on DynamoWorker "
    "{worker}) is reachable from the pods",
    "HubOffline": "HF_HUB_OFFLINE is set on the pods and the adapter is not cached; unset it "
    "or pre-fill the cache",
    "LoRADisabled": "set spec.lora.enabled: true on DynamoWorker {worker}",
    "EngineError": "the engine could not load the adapter; check that it was trained for the "
    "base model (base model, rank, target modules) and read the pod's log",
    "WorkerUnreachable": "the pod's system port did not answer; read the pod's log",
    "RequestTimeout": "the worker did not answer in time; read the pod's log",
    "NotListed": "the worker accepted the load but does not list the adapter; read the pod's log",
    "UnloadFailed": "the worker did not unload the adapter; read the pod's log",
}
DEFAULT_FIX = "read the pod's log (kubectl logs <pod> -c main)"
# When pods fail for different reasons, conditions report the first in this order.
REASON_ORDER = (
    "LoRADisabled",
    "AuthFailed",
    "SourceNotFound",
    "DigestMismatch",
    "InvalidDigest",
    "InvalidSource",
    "InvalidAdapter",
    "UnsafeSource",
    "HubOffline",
    "DownloadFailed",
    "DownloadTimeout",
    "EngineError",
    "CapacityExceeded",
)


# --- what is observed ---------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerInfo:
    """What the planner needs about one DynamoWorker."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    lora_enabled: bool = True
    max_loras: int | None = None


@dataclass(frozen=True)
class Pod:
    """A worker pod: identity, address and readiness."""

    name: str
    worker: str
    ip: str | None
    ready: bool
    terminating: bool = False

    @property
    def eligible(self) -> bool:
        """Whether adapters may be loaded onto it now (ready, addressed, not shutting down)."""
        return self.ready and bool(self.ip) and not self.terminating


@dataclass(frozen=True)
class Listing:
    """A pod's answer to `GET /v1/loras`: adapter name -> id, or why there is none."""

    loras: Mapping[str, int] | None = None
    reason: str = ""
    message: str = ""

    @property
    def count(self) -> int:
        return len(self.loras) if self.loras is not None else 0


@dataclass(frozen=True)
class InFlight:
    """A request to a pod that has not finished. `swap`: the pod served the name already."""

    op: Op
    uri: str | None = None
    sha256: str | None = None
    swap: bool = False


@dataclass(frozen=True)
class OpResult:
    """The answer to a load or unload (`reason` is CamelCase; empty when `ok`)."""

    ok: bool
    reason: str = ""
    message: str = ""
    lora_id: int | None = None


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

    def to_status(self) -> AdapterPodStatus:
        return AdapterPodStatus(
            pod=self.pod,
            worker=self.worker,
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

    @classmethod
    def of(cls, adapter: LoRAAdapter) -> Desired:
        return cls(
            name=adapter.adapter_name or "",
            uri=adapter.spec.source.uri,
            sha256=adapter.spec.source.sha256,
        )


@dataclass(frozen=True)
class Observed:
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


@dataclass(frozen=True)
class Plan:
    """What to do and what to record: requests to start, the tracks to remember, the status
    to write, pods newly verified as serving the current source, pods that lost the adapter,
    and when the next retry is due (None: nothing waits for a backoff)."""

    actions: tuple[Action, ...]
    tracks: dict[str, PodTrack]
    status: dict[str, Any]
    targets: tuple[str, ...]
    newly_loaded: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()
    next_retry_at: datetime | None = None


# --- targets, conflicts -------------------------------------------------------------------


def selector_matches(selector: LabelSelector, labels: Mapping[str, str]) -> bool:
    """Whether `labels` satisfy a label selector (every term must hold)."""
    if any(labels.get(key) != value for key, value in selector.match_labels.items()):
        return False
    for term in selector.match_expressions:
        present = term.key in labels
        value = labels.get(term.key)
        if term.operator == "In" and value not in term.values:
            return False
        if term.operator == "NotIn" and present and value in term.values:
            return False
        if term.operator == "Exists" and not present:
            return False
        if term.operator == "DoesNotExist" and present:
            return False
    return True


@dataclass(frozen=True)
class AdapterRef:
    """A LoRAAdapter as other adapters see it (for name conflicts)."""

    name: str
    uid: str
    created: str
    adapter_name: str
    worker_ref: str | None
    selector: LabelSelector | None
    # spec.requiredForReadiness, and the pods its status lists as Loaded (for the gate).
    required: bool = False
    loaded_on: frozenset[str] = frozenset()

    @classmethod
    def of(cls, adapter: LoRAAdapter, status: Mapping[str, Any] | None = None) -> AdapterRef:
        """The reference to `adapter`; `status` is its raw status, read for the pods it is
        loaded on."""
        spec = adapter.spec
        pods = [p for p in (status or {}).get("pods") or [] if isinstance(p, dict)]
        return cls(
            name=adapter.metadata.name or "",
            uid=adapter.metadata.uid or "",
            created=adapter.metadata.creation_timestamp or "",
            adapter_name=adapter.adapter_name or "",
            worker_ref=spec.worker_ref.name if spec.worker_ref is not None else None,
            selector=spec.worker_selector,
            required=spec.required_for_readiness,
            loaded_on=frozenset(
                str(p.get("pod"))
                for p in pods
                if isinstance(p, dict) and p.get("state") == "Loaded"
            ),
        )

    def targets(self, worker: WorkerInfo) -> bool:
        if self.worker_ref is not None:
            return worker.name == self.worker_ref
        return self.selector is not None and selector_matches(self.selector, worker.labels)


def required_adapters(worker: WorkerInfo, adapters: Sequence[AdapterRef]) -> list[AdapterRef]:
    """The LoRAAdapters with requiredForReadiness that target `worker`, by name."""
    return sorted((a for a in adapters if a.required and a.targets(worker)), key=lambda a: a.name)


def target_workers(ref: AdapterRef, workers: Sequence[WorkerInfo]) -> list[WorkerInfo]:
    """The existing DynamoWorkers an adapter targets, by name."""
    return sorted((w for w in workers if ref.targets(w)), key=lambda w: w.name)


def name_conflict(
    me: AdapterRef, others: Sequence[AdapterRef], workers: Sequence[WorkerInfo]
) -> str | None:
    """The name of an older LoRAAdapter serving the same adapter name on one of the same
    workers (it keeps the name; this one waits), or None."""
    mine = {w.name for w in target_workers(me, workers)}
    if me.worker_ref is not None:
        mine.add(me.worker_ref)
    rivals = []
    for other in others:
        if other.uid == me.uid or other.adapter_name != me.adapter_name:
            continue
        theirs = {w.name for w in target_workers(other, workers)}
        if other.worker_ref is not None:
            theirs.add(other.worker_ref)
        if mine & theirs and (other.created, other.name) < (me.created, me.name):
            rivals.append((other.created, other.name))
    return min(rivals)[1] if rivals else None


# --- worker answers -----------------------------------------------------------------------


_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")
_SECRET_ASSIGNMENT = re.compile(
    r"(?i)\b([A-Z0-9_]*(?:SECRET|TOKEN|PASSWORD|ACCESS_KEY|CREDENTIAL)[A-Z0-9_]*)\s*[=:]\s*\S+"
)
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{8,}\b")


def scrub(text: str, limit: int = WORKER_MESSAGE_MAX) -> str:
    """A worker's message fit for status and Events: credential-shaped parts (URI userinfo,
    `...SECRET...=value`, Hugging Face tokens) masked, whitespace collapsed, length bounded."""
    text = _USERINFO.sub(r"\1***@", text)
    text = _SECRET_ASSIGNMENT.sub(r"\1=***", text)
    text = _HF_TOKEN.sub("hf_***", text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reason_for(http_status: int, worker_reason: str | None, message: str) -> str:
    """The CamelCase reason for a failed `/v1/loras` request."""
    if worker_reason and worker_reason in WORKER_REASONS:
        return WORKER_REASONS[worker_reason]
    if message.startswith("LoRA capacity exceeded"):
        return CAPACITY_EXCEEDED
    if http_status == 404:
        return LORA_DISABLED
    return "LoadFailed"


def fix_for(reason: str, worker: str) -> str:
    """What the user does about `reason`."""
    return FIXES.get(reason, DEFAULT_FIX).format(worker=worker or "<worker>")


# --- results ------------------------------------------------------------------------------


def _changed(track: PodTrack, state: AdapterState, now: datetime) -> datetime:
    return track.since if track.state == state else now


def record_result(
    previous: PodTrack | None,
    action: Action,
    result: OpResult,
    now: datetime,
    backoff: Backoff,
) -> PodTrack | None:
    """The pod's track once `action` finished with `result` (None: nothing left to track,
    after a successful unload)."""
    if action.op == "unload":
        if result.ok or result.reason == "NotLoaded":
            return None
        attempts = (previous.attempts if previous is not None else 0) + 1
        return PodTrack(
            pod=action.pod,
            worker=action.worker,
            state=AdapterState.UNLOADING,
            since=previous.since if previous and previous.state == AdapterState.UNLOADING else now,
            uri=previous.uri if previous else None,
            sha256=previous.sha256 if previous else None,
            reason="UnloadFailed",
            message=_failure_message(
                "unload failed", result, "UnloadFailed", action.worker, backoff, attempts
            ),
            attempts=attempts,
            failed_at=now,
        )
    if result.ok:
        return PodTrack(
            pod=action.pod,
            worker=action.worker,
            state=AdapterState.LOADED,
            since=now,
            uri=action.uri,
            sha256=action.sha256,
            lora_id=result.lora_id,
            # Kept until a GET confirms the load (a confirmed load resets them).
            attempts=previous.attempts if previous is not None else 0,
            failed_at=previous.failed_at if previous is not None else None,
        )
    same_source = (
        previous is not None and previous.uri == action.uri and previous.sha256 == action.sha256
    )
    attempts = (previous.attempts if previous is not None and same_source else 0) + 1
    what = (
        "hot swap failed (the pod still serves the previous version)"
        if action.swap
        else ("load failed")
    )
    reason = result.reason or "LoadFailed"
    return PodTrack(
        pod=action.pod,
        worker=action.worker,
        state=AdapterState.FAILED,
        since=now,
        uri=action.uri,
        sha256=action.sha256,
        reason=reason,
        message=_failure_message(what, result, reason, action.worker, backoff, attempts),
        attempts=attempts,
        failed_at=now,
    )


def _failure_message(
    what: str, result: OpResult, reason: str, worker: str, backoff: Backoff, attempts: int
) -> str:
    said = scrub(result.message) if result.message else "no details"
    delay = backoff.delay(attempts)
    return (
        f"{what}: {said}. To fix: {fix_for(reason, worker)}. "
        f"Attempt {attempts}; the next one in {delay:g}s."
    )


# --- the plan -----------------------------------------------------------------------------


@dataclass
class _Round:
    """Mutable working state of one `plan()` call."""

    desired: Desired
    obs: Observed
    backoff: Backoff
    tracks: dict[str, PodTrack]
    actions: list[Action] = field(default_factory=list)
    newly_loaded: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    shown: dict[str, PodTrack] = field(default_factory=dict)
    retry_times: list[datetime] = field(default_factory=list)

    @property
    def now(self) -> datetime:
        return self.obs.now

    def set(self, track: PodTrack, shown: bool = True) -> PodTrack:
        self.tracks[track.pod] = track
        if shown:
            self.shown[track.pod] = track
        return track

    def due(self, track: PodTrack | None) -> bool:
        """Whether a failed track's backoff has elapsed (True when it has not failed)."""
        if track is None:
            return True
        at = self.backoff.retry_at(track)
        if at is None or at <= self.now:
            return True
        self.retry_times.append(at)
        return False


def _listing(obs: Observed, pod: Pod) -> Listing:
    return obs.listings.get(pod.name) or Listing(reason=WORKER_UNREACHABLE)


def _serves(obs: Observed, pod: Pod, name: str) -> bool | None:
    loras = _listing(obs, pod).loras
    return None if loras is None else name in loras


def plan(adapter: LoRAAdapter, obs: Observed, backoff: Backoff | None = None) -> Plan:
    """Actions and status for `adapter` given what was observed (see the module doc)."""
    backoff = backoff or Backoff()
    desired = Desired.of(adapter)
    tracks = {name: t for name, t in obs.tracks.items() if any(p.name == name for p in obs.pods)}
    r = _Round(desired=desired, obs=obs, backoff=backoff, tracks=tracks)
    workers = {w.name: w for w in obs.workers}
    blocked = obs.conflict is not None or obs.missing_worker is not None
    eligible = sorted(
        (p for p in obs.pods if p.worker in workers and p.eligible and not blocked),
        key=lambda p: p.name,
    )
    placement = adapter.spec.placement
    if placement.policy == "Count":
        targets, surplus, waiting = _choose_count(r, eligible, placement.replicas or 0, workers)
        target_count = min(placement.replicas or 0, len(eligible))
    else:
        targets, surplus, waiting = eligible, [], []
        target_count = len(eligible)

    swaps: list[Pod] = []
    for pod in targets:
        if _settle_target(r, pod, workers[pod.worker]):
            swaps.append(pod)
    _start_swap(r, swaps)
    for pod in surplus:
        _unload(r, pod, "placement.replicas is lower than the pods serving it")
    if obs.conflict is None:
        released = [
            p for p in obs.pods if p.eligible and p.worker not in workers and p.name in r.tracks
        ]
        for pod in released:
            _unload(r, pod, f"the pod's DynamoWorker {pod.worker} is no longer targeted")
    loaded = sum(1 for p in targets if _is_loaded(r.tracks.get(p.name), desired))
    if loaded < target_count:
        for pod in waiting:
            r.shown[pod.name] = r.tracks[pod.name]
    status = _status(adapter, r, [p.name for p in targets], loaded, target_count, workers)
    return Plan(
        actions=tuple(r.actions),
        tracks=r.tracks,
        status=status,
        targets=tuple(p.name for p in targets),
        newly_loaded=tuple(r.newly_loaded),
        lost=tuple(r.lost),
        next_retry_at=min(r.retry_times) if r.retry_times else None,
    )


def _is_loaded(track: PodTrack | None, desired: Desired) -> bool:
    return (
        track is not None
        and track.state == AdapterState.LOADED
        and track.verified
        and desired.matches(track)
    )


def _choose_count(
    r: _Round, eligible: list[Pod], count: int, workers: Mapping[str, WorkerInfo]
) -> tuple[list[Pod], list[Pod], list[Pod]]:
    """(targets, surplus to unload, pods waiting out a CapacityExceeded) for policy Count."""
    want = min(count, len(eligible))
    name = r.desired.name
    serving = [p for p in eligible if _serves(r.obs, p, name)]
    serving.sort(key=lambda p: (not r.desired.matches(r.tracks.get(p.name)), p.name))
    chosen, surplus = serving[:want], serving[want:]
    taken = {p.name for p in serving}
    rest = [p for p in eligible if p.name not in taken]

    def loading(p: Pod) -> bool:
        flight = r.obs.in_flight.get(p.name)
        return flight is not None and flight.op == "load"

    def capacity_blocked(p: Pod) -> bool:
        t = r.tracks.get(p.name)
        if t is None or t.reason != CAPACITY_EXCEEDED or not r.desired.matches(t):
            return False
        if _slot_freed(t, _listing(r.obs, p), workers[p.worker]):
            return False
        at = r.backoff.retry_at(t)
        return at is not None and at > r.now

    def sticky(p: Pod) -> bool:
        # A pod already working on (or failing for) this source keeps its place, so one bad
        # source does not spread over every pod.
        t = r.tracks.get(p.name)
        return (
            t is not None
            and r.desired.matches(t)
            and t.state in (AdapterState.PENDING, AdapterState.LOADING, AdapterState.FAILED)
            and t.reason != CAPACITY_EXCEEDED
        )

    ordered = [p for p in rest if loading(p)]
    ordered += [p for p in rest if not loading(p) and sticky(p)]
    fresh = [
        p
        for p in rest
        if not loading(p)
        and not sticky(p)
        and not capacity_blocked(p)
        and _listing(r.obs, p).loras is not None
    ]
    ordered += sorted(fresh, key=lambda p: (_listing(r.obs, p).count, p.name))
    chosen += ordered[: max(0, want - len(chosen))]
    waiting = [p for p in rest if capacity_blocked(p) and p not in chosen]
    for p in waiting:
        r.due(r.tracks[p.name])  # remember when it may be tried again
    return chosen, surplus, waiting


def _was_served(track: PodTrack | None) -> bool:
    """Whether the track says the pod served the adapter when last seen (Loaded, or Pending
    because the pod stopped answering after a verified load)."""
    return (
        track is not None
        and track.verified
        and track.state
        in (
            AdapterState.LOADED,
            AdapterState.PENDING,
        )
    )


def _settle_target(r: _Round, pod: Pod, worker: WorkerInfo) -> bool:
    """Decide one targeted pod's state, starting a fresh load when one is due. True when the
    pod serves an outdated or unknown version and waits for its turn to be swapped."""
    desired, now = r.desired, r.now
    track = r.tracks.get(pod.name)
    flight = r.obs.in_flight.get(pod.name)
    if not worker.lora_enabled:
        r.set(_disabled(pod, track, now))
        return False
    if flight is not None:
        state = AdapterState.LOADING if flight.op == "load" else AdapterState.UNLOADING
        base = track or PodTrack(pod=pod.name, worker=pod.worker, state=state, since=now)
        r.set(
            replace(
                base,
                state=state,
                since=_changed(base, state, now),
                uri=flight.uri if flight.op == "load" else base.uri,
                sha256=flight.sha256 if flight.op == "load" else base.sha256,
                reason=None,
                message=None,
            )
        )
        return False
    listing = _listing(r.obs, pod)
    if listing.loras is None:
        reason = listing.reason or WORKER_UNREACHABLE
        said = f"GET /v1/loras: {scrub(listing.message)}. " if listing.message else ""
        r.set(_pending(pod, track, now, reason, said + "To fix: " + fix_for(reason, pod.worker)))
        return False
    serving = desired.name in listing.loras
    lora_id = listing.loras.get(desired.name)
    if track is not None and desired.matches(track):
        if serving and (track.state == AdapterState.LOADED or _was_served(track)):
            if not track.verified:
                r.newly_loaded.append(pod.name)
            r.set(
                replace(
                    track,
                    state=AdapterState.LOADED,
                    since=_changed(track, AdapterState.LOADED, now),
                    lora_id=lora_id,
                    verified=True,
                    reason=None,
                    message=None,
                    attempts=0,
                    failed_at=None,
                )
            )
            return False
        if not serving and _was_served(track):
            # Served before, gone now: the worker restarted. Load again at once.
            r.lost.append(pod.name)
            track = PodTrack(
                pod=pod.name,
                worker=pod.worker,
                state=AdapterState.PENDING,
                since=now,
                uri=desired.uri,
                sha256=desired.sha256,
                reason="NotServed",
                message="the pod no longer lists the adapter (its worker restarted?); "
                "loading it again",
            )
        elif not serving and track.state == AdapterState.LOADED:
            # Accepted by the worker, yet not listed: a failure, retried with backoff.
            action = Action("load", pod.name, pod.worker, pod.ip or "", desired.uri, desired.sha256)
            result = OpResult(ok=False, reason="NotListed", message="GET /v1/loras omits it")
            track = record_result(track, action, result, now, r.backoff)
    if serving:
        # An older or unknown version: swapped when the rollout reaches this pod.
        if track is not None and track.state == AdapterState.FAILED and desired.matches(track):
            r.set(track)
        else:
            r.set(_outdated(pod, track, lora_id, now))
        return True
    # Not served: load the current source, unless a failure's backoff has not elapsed.
    waiting = track is not None and desired.matches(track) and track.failed_at is not None
    if (
        track is not None
        and waiting
        and not _slot_freed(track, listing, worker)
        and not r.due(track)
    ):
        if track.state != AdapterState.FAILED:
            track = replace(
                track,
                state=AdapterState.PENDING,
                since=_changed(track, AdapterState.PENDING, now),
                reason="BackingOff",
                message=f"waiting out the backoff after attempt {track.attempts} failed",
            )
        r.set(track)
        return False
    _load(r, pod, track, swap=False)
    return False


def _slot_freed(track: PodTrack, listing: Listing, worker: WorkerInfo) -> bool:
    """Whether a pod that answered CapacityExceeded now lists fewer adapters than its
    capacity (another adapter was unloaded): it is tried again without waiting."""
    return (
        track.reason == CAPACITY_EXCEEDED
        and worker.max_loras is not None
        and listing.count < worker.max_loras
    )


def _outdated(pod: Pod, track: PodTrack | None, lora_id: int | None, now: datetime) -> PodTrack:
    """A pod that serves the name from another source than spec.source (or an unknown one)."""
    old = track.uri if track is not None and _was_served(track) else None
    what = f"the previous source {old}" if old else "an adapter of this name from an unknown source"
    return PodTrack(
        pod=pod.name,
        worker=pod.worker,
        state=AdapterState.LOADED,
        since=track.since if track and track.state == AdapterState.LOADED else now,
        uri=old,
        sha256=track.sha256 if old and track is not None else None,
        lora_id=lora_id,
        reason="OutdatedSource",
        message=f"serves {what}; the rollout replaces it with spec.source one pod at a time",
        verified=True,
    )


def _disabled(pod: Pod, track: PodTrack | None, now: datetime) -> PodTrack:
    return PodTrack(
        pod=pod.name,
        worker=pod.worker,
        state=AdapterState.FAILED,
        since=_changed(track, AdapterState.FAILED, now) if track else now,
        reason=LORA_DISABLED,
        message=f"DynamoWorker {pod.worker} does not serve LoRA adapters. To fix: "
        + fix_for(LORA_DISABLED, pod.worker),
    )


def _pending(
    pod: Pod, track: PodTrack | None, now: datetime, reason: str, message: str
) -> PodTrack:
    return PodTrack(
        pod=pod.name,
        worker=pod.worker,
        state=AdapterState.PENDING,
        since=_changed(track, AdapterState.PENDING, now) if track else now,
        uri=track.uri if track else None,
        sha256=track.sha256 if track else None,
        reason=reason,
        message=message,
        attempts=track.attempts if track else 0,
        failed_at=track.failed_at if track else None,
        # Keeps `verified` so a restarted worker is noticed once it answers again.
        verified=track.verified if track else False,
    )


def _load(r: _Round, pod: Pod, track: PodTrack | None, *, swap: bool) -> None:
    d = r.desired
    r.actions.append(Action("load", pod.name, pod.worker, pod.ip or "", d.uri, d.sha256, swap))
    keep = track is not None and d.matches(track)
    r.set(
        PodTrack(
            pod=pod.name,
            worker=pod.worker,
            state=AdapterState.LOADING,
            since=r.now if track is None else _changed(track, AdapterState.LOADING, r.now),
            uri=d.uri,
            sha256=d.sha256,
            attempts=track.attempts if track is not None and keep else 0,
            failed_at=track.failed_at if track is not None and keep else None,
        )
    )


def _start_swap(r: _Round, waiting: list[Pod]) -> None:
    """Start at most one hot swap: none while one is in flight; after a failed swap, only
    that pod's retry (once its backoff elapsed)."""
    if any(f.op == "load" and f.swap for f in r.obs.in_flight.values()):
        return
    failed = [p for p in waiting if r.tracks[p.name].state == AdapterState.FAILED]
    if failed:
        pod = failed[0]
        if r.due(r.tracks[pod.name]):
            _load(r, pod, r.tracks[pod.name], swap=True)
        return
    if waiting:
        pod = waiting[0]
        _load(r, pod, r.tracks.get(pod.name), swap=True)


def _unload(r: _Round, pod: Pod, why: str) -> None:
    """Unload the adapter from a pod that should not serve it (when it does)."""
    track = r.tracks.get(pod.name)
    if r.obs.in_flight.get(pod.name) is not None:
        if track is not None:
            r.set(track)  # wait for the request in flight
        return
    serving = _serves(r.obs, pod, r.desired.name)
    if serving is None:
        if track is not None:
            r.set(track)  # cannot tell now; asked again next time
        return
    if not serving:
        r.tracks.pop(pod.name, None)
        return
    if track is not None and track.state == AdapterState.UNLOADING and not r.due(track):
        r.set(track)
        return
    r.actions.append(Action("unload", pod.name, pod.worker, pod.ip or ""))
    base = track or PodTrack(
        pod=pod.name, worker=pod.worker, state=AdapterState.UNLOADING, since=r.now
    )
    r.set(
        replace(
            base,
            state=AdapterState.UNLOADING,
            since=_changed(base, AdapterState.UNLOADING, r.now),
            reason="Unloading",
            message=why,
        )
    )


# --- status -------------------------------------------------------------------------------


_Wanted = WantedCondition


def _names(pods: Sequence[str]) -> str:
    return name_list(pods, NAMED_PODS)


def _first_failure(tracks: Sequence[PodTrack]) -> tuple[str, list[PodTrack]] | None:
    failing = [
        t
        for t in tracks
        if t.state == AdapterState.FAILED
        or (t.state == AdapterState.PENDING and t.reason == LORA_DISABLED)
    ]
    if not failing:
        return None
    order = {reason: i for i, reason in enumerate(REASON_ORDER)}
    failing.sort(key=lambda t: (order.get(t.reason or "", len(order)), t.pod))
    reason = failing[0].reason or "LoadFailed"
    return reason, [t for t in failing if t.reason == reason]


def _conditions(
    adapter: LoRAAdapter,
    r: _Round,
    targets: Sequence[str],
    loaded: int,
    target_count: int,
    workers: Mapping[str, WorkerInfo],
) -> list[_Wanted]:
    obs, d = r.obs, r.desired
    ready, progressing, degraded = (
        ConditionType.READY,
        ConditionType.PROGRESSING,
        (ConditionType.DEGRADED),
    )
    if obs.conflict is not None:
        message = (
            f"LoRAAdapter {obs.conflict} already serves the name {d.name!r} on the same "
            "DynamoWorker; set a different spec.adapterName or delete one of them"
        )
        return [
            _Wanted(ready, "False", "NameConflict", message),
            _Wanted(
                progressing, "False", "NameConflict", "nothing is loaded while the names clash"
            ),
            _Wanted(degraded, "True", "NameConflict", message),
        ]
    if obs.missing_worker is not None:
        message = obs.missing_worker
        return [
            _Wanted(ready, "False", "WorkerNotFound", message),
            _Wanted(progressing, "False", "WorkerNotFound", "waiting for the DynamoWorker"),
            _Wanted(degraded, "True", "WorkerNotFound", message),
        ]
    target_tracks = [r.tracks[name] for name in targets if name in r.tracks]
    shown_tracks = list(r.shown.values())
    failure = _first_failure(shown_tracks)
    names = ", ".join(sorted(workers))
    if target_count == 0:
        message = (
            f"DynamoWorker {names} has no ready pods; the adapter is loaded onto each pod "
            "when it becomes ready"
        )
        return [
            _Wanted(ready, "False", "NoReadyPods", message),
            _Wanted(progressing, "False", "NoReadyPods", message),
            _Wanted(degraded, "False", "AsExpected", "no problems observed"),
        ]
    busy = any(t.state in (AdapterState.LOADING, AdapterState.UNLOADING) for t in shown_tracks)
    rolling = any(t.reason == "OutdatedSource" for t in target_tracks)
    summary = f"{loaded} of {target_count} pods serve {d.name!r} from {d.uri}"
    if failure is not None:
        reason, failing = failure
        pods = _names([t.pod for t in failing])
        subject = f"pod {pods}" if len(failing) == 1 else f"pods {pods}"
        wanted_degraded = _Wanted(degraded, "True", reason, f"{subject}: {failing[0].message}")
    else:
        wanted_degraded = _Wanted(degraded, "False", "AsExpected", "no problems observed")
    if loaded >= target_count:
        wanted_ready = _Wanted(ready, "True", "AllLoaded", summary)
    elif failure is not None:
        wanted_ready = _Wanted(ready, "False", failure[0], summary)
    elif rolling:
        wanted_ready = _Wanted(ready, "False", "RollingOut", summary)
    elif any(t.reason == WORKER_UNREACHABLE for t in target_tracks):
        wanted_ready = _Wanted(ready, "False", WORKER_UNREACHABLE, summary)
    else:
        wanted_ready = _Wanted(ready, "False", "Loading", summary)
    if rolling:
        wanted_progressing = _Wanted(
            progressing,
            "True",
            "RollingOut",
            f"{summary}; the others are updated one pod at a time",
        )
    elif busy or r.actions:
        loading = any(a.op == "load" for a in r.actions) or any(
            t.state == AdapterState.LOADING for t in shown_tracks
        )
        reason = "Loading" if loading or loaded < target_count else "Unloading"
        wanted_progressing = _Wanted(progressing, "True", reason, summary)
    elif loaded < target_count and failure is not None:
        wanted_progressing = _Wanted(
            progressing,
            "True",
            "RetryingWithBackoff",
            f"{summary}; failed pods are retried with exponential backoff",
        )
    elif loaded < target_count:
        wanted_progressing = _Wanted(progressing, "True", "Loading", summary)
    else:
        wanted_progressing = _Wanted(progressing, "False", "Complete", summary)
    return [wanted_ready, wanted_progressing, wanted_degraded]


def _source_pinned(adapter: LoRAAdapter) -> _Wanted | None:
    """The hf:// warning: a repository without a pinned revision and without sha256 may
    change under the adapter, so pods could serve different versions."""
    source = adapter.spec.source
    if not source.uri.startswith("hf://"):
        return None
    if "@" in source.uri or source.sha256 is not None:
        return _Wanted(SOURCE_PINNED, "True", "Pinned", "the source names a fixed version")
    return _Wanted(
        SOURCE_PINNED,
        "False",
        "UnpinnedRevision",
        f"{source.uri} names no revision and spec.source.sha256 is unset: pods loading at "
        "different times may get different versions; pin a revision "
        f"({source.uri}@<commit>) or set spec.source.sha256",
    )


def _status(
    adapter: LoRAAdapter,
    r: _Round,
    targets: Sequence[str],
    loaded: int,
    target_count: int,
    workers: Mapping[str, WorkerInfo],
) -> dict[str, Any]:
    generation = adapter.metadata.generation or 0
    existing = adapter.status.conditions if adapter.status is not None else []
    if not adapter.spec.source.uri.startswith("hf://"):
        existing = [c for c in existing if c.type != SOURCE_PINNED]
    wanted = _conditions(adapter, r, targets, loaded, target_count, workers)
    pinned = _source_pinned(adapter)
    if pinned is not None:
        wanted.append(pinned)
    conditions = apply_conditions(existing, wanted, generation=generation, at=r.now)
    pods = [r.shown[name].to_status() for name in sorted(r.shown)][:MAX_STATUS_PODS]
    status = LoRAAdapterStatus(
        observed_generation=generation,
        adapter_name=r.desired.name or None,
        pods=pods,
        loaded_replicas=min(loaded, MAX_STATUS_PODS),
        target_replicas=min(target_count, MAX_STATUS_PODS),
        loaded=f"{loaded}/{target_count}",
        conditions=conditions,
    )
    return status.to_dict()


def normalized_status(raw: Mapping[str, Any] | None) -> dict[str, Any]:
    """A stored status as `plan` writes it, so the two compare equal when nothing changed."""
    return LoRAAdapterStatus.model_validate(dict(raw or {})).to_dict()


def missing_worker_message(adapter: LoRAAdapter) -> str:
    """Why no DynamoWorker is targeted, naming the field to fix."""
    spec = adapter.spec
    namespace = adapter.metadata.namespace or "the namespace"
    if spec.worker_ref is not None:
        return (
            f"DynamoWorker {spec.worker_ref.name} does not exist in {namespace}; create it or "
            "fix spec.workerRef.name"
        )
    return (
        f"no DynamoWorker in {namespace} matches spec.workerSelector; label one or fix the selector"
    )


# --- Events -------------------------------------------------------------------------------


def event_manifest(
    owner: Mapping[str, Any],
    *,
    reason: str,
    note: str,
    event_type: str,
    action: str,
    now: datetime,
    reporting_instance: str,
) -> dict[str, Any]:
    """An events.k8s.io/v1 Event about the LoRAAdapter `owner` (its metadata)."""
    name = str(owner["name"])
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": f"{name}.{secrets.token_hex(8)}", "namespace": owner["namespace"]},
        "eventTime": now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": reporting_instance[:128],
        "action": action,
        "reason": reason[:128],
        "type": event_type,
        "note": note[:NOTE_MAX],
        "regarding": {
            "apiVersion": "dynamo.dev/v1alpha1",
            "kind": KIND,
            "name": name,
            "namespace": owner["namespace"],
            "uid": owner["uid"],
        },
    }
