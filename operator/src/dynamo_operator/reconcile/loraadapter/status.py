"""LoRAAdapter.status from what the plan decided (pure).

Conditions: `Ready` (every targeted pod serves the current source), `Progressing` (loads,
unloads or a rollout under way, or retries waiting out their backoff), `Degraded` (a name
clash, no DynamoWorker, pods failing: the message names the first reason of
`reasons.REASON_ORDER` and its fix), and for hf:// sources `SourcePinned`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dynamo_operator.api.common import ConditionType
from dynamo_operator.api.conditions import WantedCondition, apply_conditions, name_list
from dynamo_operator.api.dynamoworker import MAX_STATUS_PODS
from dynamo_operator.api.loraadapter import AdapterState, LoRAAdapter, LoRAAdapterStatus
from dynamo_operator.pods.adapters import LORA_DISABLED, WORKER_UNREACHABLE
from dynamo_operator.reconcile.loraadapter.model import (
    Action,
    AdapterObservation,
    Desired,
    PodTrack,
)
from dynamo_operator.reconcile.loraadapter.reasons import REASON_ORDER
from dynamo_operator.reconcile.loraadapter.targeting import WorkerInfo

SOURCE_PINNED = "SourcePinned"


@dataclass(frozen=True)
class Placement:
    """What one plan decided, as status reports it: the tracks of every pod, those shown in
    status, the requests started, the targeted pods and how many of them serve the current
    source (of `target_count` wanted), and the targeted workers by name."""

    observation: AdapterObservation
    desired: Desired
    tracks: Mapping[str, PodTrack]
    shown: Mapping[str, PodTrack]
    actions: Sequence[Action]
    targets: Sequence[str]
    loaded: int
    target_count: int
    workers: Mapping[str, WorkerInfo]


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


def _conditions(p: Placement) -> list[WantedCondition]:
    obs, d = p.observation, p.desired
    loaded, target_count = p.loaded, p.target_count
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
            WantedCondition(ready, "False", "NameConflict", message),
            WantedCondition(
                progressing, "False", "NameConflict", "nothing is loaded while the names clash"
            ),
            WantedCondition(degraded, "True", "NameConflict", message),
        ]
    if obs.missing_worker is not None:
        message = obs.missing_worker
        return [
            WantedCondition(ready, "False", "WorkerNotFound", message),
            WantedCondition(progressing, "False", "WorkerNotFound", "waiting for the DynamoWorker"),
            WantedCondition(degraded, "True", "WorkerNotFound", message),
        ]
    target_tracks = [p.tracks[name] for name in p.targets if name in p.tracks]
    shown_tracks = list(p.shown.values())
    failure = _first_failure(shown_tracks)
    names = ", ".join(sorted(p.workers))
    if target_count == 0:
        message = (
            f"DynamoWorker {names} has no ready pods; the adapter is loaded onto each pod "
            "when it becomes ready"
        )
        return [
            WantedCondition(ready, "False", "NoReadyPods", message),
            WantedCondition(progressing, "False", "NoReadyPods", message),
            WantedCondition(degraded, "False", "AsExpected", "no problems observed"),
        ]
    busy = any(t.state in (AdapterState.LOADING, AdapterState.UNLOADING) for t in shown_tracks)
    rolling = any(t.reason == "OutdatedSource" for t in target_tracks)
    summary = f"{loaded} of {target_count} pods serve {d.name!r} from {d.uri}"
    if failure is not None:
        reason, failing = failure
        pods = name_list([t.pod for t in failing])
        subject = f"pod {pods}" if len(failing) == 1 else f"pods {pods}"
        wanted_degraded = WantedCondition(
            degraded, "True", reason, f"{subject}: {failing[0].message}"
        )
    else:
        wanted_degraded = WantedCondition(degraded, "False", "AsExpected", "no problems observed")
    if loaded >= target_count:
        wanted_ready = WantedCondition(ready, "True", "AllLoaded", summary)
    elif failure is not None:
        wanted_ready = WantedCondition(ready, "False", failure[0], summary)
    elif rolling:
        wanted_ready = WantedCondition(ready, "False", "RollingOut", summary)
    elif any(t.reason == WORKER_UNREACHABLE for t in target_tracks):
        wanted_ready = WantedCondition(ready, "False", WORKER_UNREACHABLE, summary)
    else:
        wanted_ready = WantedCondition(ready, "False", "Loading", summary)
    if rolling:
        wanted_progressing = WantedCondition(
            progressing,
            "True",
            "RollingOut",
            f"{summary}; the others are updated one pod at a time",
        )
    elif busy or p.actions:
        loading = any(a.op == "load" for a in p.actions) or any(
            t.state == AdapterState.LOADING for t in shown_tracks
        )
        reason = "Loading" if loading or loaded < target_count else "Unloading"
        wanted_progressing = WantedCondition(progressing, "True", reason, summary)
    elif loaded < target_count and failure is not None:
        wanted_progressing = WantedCondition(
            progressing,
            "True",
            "RetryingWithBackoff",
            f"{summary}; failed pods are retried with exponential backoff",
        )
    elif loaded < target_count:
        wanted_progressing = WantedCondition(progressing, "True", "Loading", summary)
    else:
        wanted_progressing = WantedCondition(progressing, "False", "Complete", summary)
    return [wanted_ready, wanted_progressing, wanted_degraded]


def _source_pinned(adapter: LoRAAdapter) -> WantedCondition | None:
    """The hf:// warning: a repository without a pinned revision and without sha256 may
    change under the adapter, so pods could serve different versions."""
    source = adapter.spec.source
    if not source.uri.startswith("hf://"):
        return None
    if "@" in source.uri or source.sha256 is not None:
        return WantedCondition(SOURCE_PINNED, "True", "Pinned", "the source names a fixed version")
    return WantedCondition(
        SOURCE_PINNED,
        "False",
        "UnpinnedRevision",
        f"{source.uri} names no revision and spec.source.sha256 is unset: pods loading at "
        "different times may get different versions; pin a revision "
        f"({source.uri}@<commit>) or set spec.source.sha256",
    )


def compute_status(adapter: LoRAAdapter, p: Placement) -> dict[str, Any]:
    """The status the LoRAAdapter should have, as the API server stores it (camelCase)."""
    loaded, target_count = p.loaded, p.target_count
    generation = adapter.metadata.generation or 0
    existing = adapter.status.conditions if adapter.status is not None else []
    if not adapter.spec.source.uri.startswith("hf://"):
        existing = [c for c in existing if c.type != SOURCE_PINNED]
    wanted = _conditions(p)
    pinned = _source_pinned(adapter)
    if pinned is not None:
        wanted.append(pinned)
    conditions = apply_conditions(existing, wanted, generation=generation, at=p.observation.now)
    roles = {pod.name: pod.role for pod in p.observation.pods}
    pods = [p.shown[name].to_status(roles.get(name)) for name in sorted(p.shown)]
    pods = pods[:MAX_STATUS_PODS]
    status = LoRAAdapterStatus(
        observed_generation=generation,
        adapter_name=p.desired.name or None,
        pods=pods,
        loaded_replicas=min(loaded, MAX_STATUS_PODS),
        target_replicas=min(target_count, MAX_STATUS_PODS),
        loaded=f"{loaded}/{target_count}",
        conditions=conditions,
    )
    return status.to_dict()
