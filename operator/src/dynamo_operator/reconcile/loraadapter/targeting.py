"""Which DynamoWorkers a LoRAAdapter targets, and which adapters clash over a name (pure).

`WorkerInfo` is a DynamoWorker as its adapters see it, `AdapterRef` a LoRAAdapter as the
other adapters and its workers see it; the handlers' indices hold both, so these joins read
nothing from the API server.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from dynamo_operator.api.common import LabelSelector
from dynamo_operator.api.dynamoworker import LoRASettings
from dynamo_operator.api.loraadapter import LoRAAdapter


@dataclass(frozen=True)
class WorkerInfo:
    """What the planner needs about one DynamoWorker."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    lora_enabled: bool = True
    max_loras: int | None = None

    @classmethod
    def of(
        cls, name: str, labels: Mapping[str, str] | None, spec: Mapping[str, Any] | None
    ) -> WorkerInfo:
        """A DynamoWorker as its watch delivers it. Only spec.lora is read (so one DynamoWorker
        whose spec the models refuse elsewhere still counts as a target); a spec.lora the
        models refuse counts as LoRA off."""
        try:
            lora = LoRASettings.model_validate((spec or {}).get("lora") or {})
        except ValidationError:
            lora = LoRASettings()
        return cls(
            name=name,
            labels=dict(labels or {}),
            lora_enabled=lora.enabled,
            max_loras=lora.effective_max_loras,
        )


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
    def of_body(cls, body: Mapping[str, Any]) -> AdapterRef:
        """The reference to the LoRAAdapter `body` as its watch delivers it, status included;
        raises pydantic's ValidationError when the object is unreadable."""
        adapter = LoRAAdapter.model_validate({**body, "status": None})
        return cls.of(adapter, body.get("status"))

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


def adapters_targeting(
    worker: str, workers: Sequence[WorkerInfo], adapters: Sequence[AdapterRef]
) -> list[str]:
    """The names of the LoRAAdapters that target the DynamoWorker named `worker` (known or
    not: a worker that just went away is still targeted by name)."""
    known = {w.name: w for w in workers}
    info = known.get(worker) or WorkerInfo(worker)
    return [ref.name for ref in adapters if ref.targets(info)]
