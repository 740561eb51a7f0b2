"""LoRAAdapter planning (pure): which pods load or unload the adapter, and what to record.

Inputs are observations (the targeted DynamoWorkers, their pods, each ready pod's answer to
`GET /v1/loras`, the requests in flight) plus what the operator remembers per pod (a
`PodTrack`: the state it last recorded, the source it refers to, attempts and when the last
one failed). `plan()` turns them into actions and the status to write; `record_result()`
folds the answer of a finished request into a pod's track. No clock, no I/O: the caller
passes `now`. The records are in `model`, targeting in `targeting`, what each failure
reason means in `reasons`, and the status the plan writes is computed by `status`.

Rules:
- Verify, do not assume. A pod is `Loaded` only when its `GET /v1/loras` lists the adapter
  and the operator's last successful load on that pod was of the current source, or the
  listing itself names the current source as the one served (our workers say). A pod
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

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from dynamo_operator.api.loraadapter import AdapterState, LoRAAdapter
from dynamo_operator.pods.adapters import (
    CAPACITY_EXCEEDED,
    LORA_DISABLED,
    WORKER_UNREACHABLE,
    Listing,
    OpResult,
)
from dynamo_operator.reconcile.loraadapter.model import (
    Action,
    AdapterObservation,
    Backoff,
    Desired,
    Pod,
    PodTrack,
)
from dynamo_operator.reconcile.loraadapter.reasons import fix_for, scrub
from dynamo_operator.reconcile.loraadapter.status import Placement, compute_status
from dynamo_operator.reconcile.loraadapter.targeting import WorkerInfo


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


@dataclass
class _Round:
    """Mutable working state of one `plan()` call."""

    desired: Desired
    obs: AdapterObservation
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


def _listing(obs: AdapterObservation, pod: Pod) -> Listing:
    return obs.listings.get(pod.name) or Listing(reason=WORKER_UNREACHABLE)


def _serves(obs: AdapterObservation, pod: Pod, name: str) -> bool | None:
    loras = _listing(obs, pod).loras
    return None if loras is None else name in loras


def plan(adapter: LoRAAdapter, obs: AdapterObservation, backoff: Backoff | None = None) -> Plan:
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
    status = compute_status(
        adapter,
        Placement(
            observation=obs,
            desired=desired,
            tracks=r.tracks,
            shown=r.shown,
            actions=r.actions,
            targets=[p.name for p in targets],
            loaded=loaded,
            target_count=target_count,
            workers=workers,
        ),
    )
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
    recorded = desired.matches(track) and track is not None and track.state == AdapterState.LOADED
    if serving and not recorded and desired.served_by(listing):
        # The pod says it serves this very source although no finished load of it is
        # recorded (an operator killed before recording it, or a status lost): adopt it, do
        # not load it again.
        base = track or PodTrack(pod.name, pod.worker, AdapterState.LOADED, since=now)
        track = replace(
            base, state=AdapterState.LOADED, uri=desired.uri, sha256=desired.sha256,
            verified=False, attempts=0, failed_at=None,
        )  # fmt: skip
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
