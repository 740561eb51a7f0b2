"""The readiness gate of LoRAAdapters with requiredForReadiness (pure).

While such an adapter targets a DynamoWorker, the worker's pod template carries the readiness
gate `dynamo.dev/lora-adapters-ready`, so a pod is Ready (in its Service's EndpointSlices,
hence routable by upstream's frontend) only once the operator sets that condition True: when
every required adapter's status lists the pod as Loaded. The adapters are loaded onto pods
whose containers are ready, so the gate never keeps a pod from getting its adapters.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

from dynamo_operator.api.common import format_timestamp
from dynamo_operator.reconcile.dynamoworker.labels import ADAPTERS_READY_GATE
from dynamo_operator.reconcile.dynamoworker.pod_summary import PodSummary


class RequiredAdapter(Protocol):
    """A LoRAAdapter with requiredForReadiness as the gate sees it (`loraadapter.targeting`'s
    `AdapterRef`, which depends on this package, not the other way round)."""

    @property
    def name(self) -> str: ...
    @property
    def loaded_on(self) -> frozenset[str]: ...


def wanted_condition(
    pod: PodSummary, required: Sequence[RequiredAdapter], now: datetime
) -> dict[str, Any] | None:
    """The gate condition `pod` should get, or None when it has it already (or carries no
    gate, or is going away)."""
    if not pod.gated or pod.terminating:
        return None
    missing = [a.name for a in required if pod.name not in a.loaded_on]
    status = "False" if missing else "True"
    if pod.gate_status == status:
        return None
    if missing:
        reason = "AdaptersLoading"
        message = f"waiting for LoRAAdapter(s) {', '.join(missing)} (requiredForReadiness)"
    else:
        reason = "AdaptersLoaded"
        message = "every LoRAAdapter with requiredForReadiness is loaded"
    return {
        "type": ADAPTERS_READY_GATE,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": format_timestamp(now),
    }
