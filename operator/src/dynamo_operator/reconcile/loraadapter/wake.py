"""Which objects a watch event wakes (pure): the cross-kind wake decisions of LoRAAdapters.

An adapter's daemon reconciles when something it depends on changes: its own spec, a pod of a
worker it targets, a targeted worker appearing or going away. A DynamoWorker reconciles when
the readiness gate of its pods may change: a required adapter's per-pod states (its status),
or whether there is one at all (an adapter's spec, its deletion).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from dynamo_operator.reconcile.loraadapter.targeting import (
    AdapterRef,
    WorkerInfo,
    adapters_targeting,
)


@dataclass(frozen=True)
class AdapterWake:
    """What a LoRAAdapter's event wakes: the adapter itself, and DynamoWorkers by name."""

    adapter: bool = False
    workers: tuple[str, ...] = ()


def on_adapter_event(
    event_type: str | None, body: Mapping[str, Any], workers: Sequence[WorkerInfo]
) -> AdapterWake:
    """For an event of the LoRAAdapter `body` (`event_type` None: the initial listing, after
    which every daemon reconciles anyway), given the namespace's DynamoWorkers."""
    if event_type is None:
        return AdapterWake()
    # A spec change is a new generation; the operator's own status writes are not.
    observed = (body.get("status") or {}).get("observedGeneration")
    spec_changed = observed != (body.get("metadata") or {}).get("generation")
    required = bool((body.get("spec") or {}).get("requiredForReadiness"))
    targeted: tuple[str, ...] = ()
    if required or spec_changed or event_type == "DELETED":
        try:
            ref = AdapterRef.of_body(body)
        except ValidationError:
            ref = None  # an unreadable adapter targets nothing
        if ref is not None:
            targeted = tuple(w.name for w in workers if ref.targets(w))
    return AdapterWake(adapter=event_type == "MODIFIED" and spec_changed, workers=targeted)


def on_pod_event(
    event_type: str | None,
    worker: str,
    workers: Sequence[WorkerInfo],
    adapters: Sequence[AdapterRef],
) -> list[str]:
    """The LoRAAdapters an event of a pod of the DynamoWorker `worker` wakes."""
    if event_type is None:
        return []  # the initial listing: every daemon reconciles on start anyway
    return adapters_targeting(worker, workers, adapters)


def on_worker_event(
    event_type: str | None,
    worker: str,
    workers: Sequence[WorkerInfo],
    adapters: Sequence[AdapterRef],
) -> list[str]:
    """The LoRAAdapters an event of the DynamoWorker `worker` wakes: a worker appearing or
    going away changes what they target; its other changes reach them through its pods (or
    the resync)."""
    if event_type not in ("ADDED", "DELETED"):
        return []
    return adapters_targeting(worker, workers, adapters)
