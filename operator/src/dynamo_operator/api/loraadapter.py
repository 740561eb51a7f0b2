"""`LoRAAdapter` (dynamo.dev/v1alpha1, short name `lora`): one adapter loaded onto live workers."""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar, Literal

from pydantic import Field

from dynamo_operator.api.base import ApiModel, Rule, StatusModel
from dynamo_operator.api.common import (
    GROUP,
    JSON_SAFE_INT_MAX,
    VERSION,
    Condition,
    DnsSubdomain,
    LabelSelector,
    Message,
    ModelName,
    Reason,
    Timestamp,
    conditions_field,
    defaulted,
)
from dynamo_operator.api.dynamoworker import MAX_REPLICAS, MAX_STATUS_PODS, WorkerRole
from dynamo_operator.api.resource import (
    AGE_COLUMN,
    PrinterColumn,
    Resource,
    ResourceInfo,
    condition_column,
)
from dynamo_operator.api.sources import URI_MAX_LENGTH, uri_rules

KIND = "LoRAAdapter"
PLURAL = "loraadapters"
SHA256_PATTERN = r"^[0-9a-f]{64}$"
MAX_ATTEMPTS = 1_000_000


class WorkerRef(ApiModel):
    """A DynamoWorker in the same namespace."""

    name: DnsSubdomain = Field(description="Name of the DynamoWorker.")


class AdapterSource(ApiModel):
    """Where the adapter files are. Credentials come from the DynamoWorker's Secret
    references, never from here."""

    uri: str = Field(
        min_length=1,
        max_length=URI_MAX_LENGTH,
        description="s3://bucket/prefix, hf://org/repo@revision or file:///path.",
    )
    sha256: str | None = Field(
        default=None,
        pattern=SHA256_PATTERN,
        max_length=64,
        description="SHA-256 of the adapter files (64 lowercase hex), checked by the worker "
        "before loading.",
    )

    cel_rules = uri_rules("uri", "spec.source.uri", lambda s: s.uri)


PlacementPolicy = Literal["AllReplicas", "Count"]
PlacementStrategy = Literal["FewestAdaptersFirst"]


class Placement(ApiModel):
    """Which ready pods of the target load the adapter."""

    policy: PlacementPolicy = Field(
        default="AllReplicas",
        description="AllReplicas: every ready pod. Count: `replicas` pods chosen by strategy.",
    )
    replicas: int | None = Field(
        default=None,
        ge=1,
        le=MAX_REPLICAS,
        description="How many pods load the adapter (policy Count only).",
    )
    strategy: PlacementStrategy = Field(
        default="FewestAdaptersFirst",
        description="How pods are chosen for policy Count: those with the fewest adapters.",
    )

    cel_rules = (
        Rule(
            rule="self.policy != 'Count' || has(self.replicas)",
            message="spec.placement.replicas is required when spec.placement.policy is Count",
            check=lambda p: p.policy != "Count" or p.replicas is not None,
            field_path=".replicas",
        ),
        Rule(
            rule="self.policy == 'Count' || !has(self.replicas)",
            message="spec.placement.replicas is only used with policy: Count; "
            "remove it or set policy: Count",
            check=lambda p: p.policy == "Count" or p.replicas is None,
            field_path=".replicas",
        ),
    )


def _unchanged(field: str) -> str:
    """CEL: an optional field neither appears, disappears nor changes on update."""
    return (
        f"has(self.{field}) == has(oldSelf.{field}) && "
        f"(!has(self.{field}) || self.{field} == oldSelf.{field})"
    )


class LoRAAdapterSpec(ApiModel):
    """The desired state of a LoRAAdapter."""

    worker_ref: WorkerRef | None = Field(
        default=None,
        description="The DynamoWorker whose pods load the adapter (immutable).",
    )
    worker_selector: LabelSelector | None = Field(
        default=None,
        description="Instead of workerRef: every DynamoWorker in the namespace whose labels match.",
    )
    adapter_name: ModelName | None = Field(
        default=None,
        description="Name clients send in the `model` field; metadata.name when unset (immutable).",
    )
    source: AdapterSource = Field(description="Where the adapter files are.")
    placement: Placement = defaulted(Placement, "Which ready pods load the adapter.")
    required_for_readiness: bool = Field(
        default=False,
        description=(
            "Worker pods report Ready (and so get traffic, from a Service or upstream's "
            "frontend) only once this adapter is loaded on them. While such an adapter "
            "targets a DynamoWorker, its pods carry the readiness gate "
            "dynamo.dev/lora-adapters-ready (adding or removing the gate rolls the pods once). "
            "Needs placement policy AllReplicas."
        ),
    )

    cel_rules = (
        Rule(
            rule="has(self.workerRef) != has(self.workerSelector)",
            message="spec: set exactly one of workerRef or workerSelector",
            check=lambda s: (s.worker_ref is None) != (s.worker_selector is None),
        ),
        Rule(
            rule="!has(self.requiredForReadiness) || !self.requiredForReadiness"
            " || !has(self.placement) || self.placement.policy == 'AllReplicas'",
            message="spec.requiredForReadiness needs spec.placement.policy AllReplicas (a pod "
            "that is not chosen to load the adapter would never become ready)",
            check=lambda s: not s.required_for_readiness or s.placement.policy == "AllReplicas",
            field_path=".requiredForReadiness",
        ),
        Rule(
            rule=_unchanged("workerRef"),
            message="spec.workerRef is immutable; create a new LoRAAdapter to target "
            "another DynamoWorker",
            field_path=".workerRef",
            reason="FieldValueForbidden",
        ),
        Rule(
            rule=_unchanged("adapterName"),
            message="spec.adapterName is immutable; create a new LoRAAdapter to serve another name",
            field_path=".adapterName",
            reason="FieldValueForbidden",
        ),
    )


class AdapterState(StrEnum):
    """Where the adapter stands on one pod."""

    PENDING = "Pending"
    LOADING = "Loading"
    LOADED = "Loaded"
    FAILED = "Failed"
    UNLOADING = "Unloading"


class AdapterPodStatus(StatusModel):
    """The adapter on one pod."""

    pod: str = Field(min_length=1, max_length=253, description="Pod name.")
    worker: str | None = Field(
        default=None, max_length=253, description="DynamoWorker the pod belongs to."
    )
    role: WorkerRole | None = Field(
        default=None,
        description="The pod's role in a disaggregated DynamoWorker (prefill or decode); "
        "absent for an aggregated one.",
    )
    state: AdapterState = Field(description="Pending, Loading, Loaded, Failed or Unloading.")
    lora_id: int | None = Field(
        default=None, ge=0, le=JSON_SAFE_INT_MAX, description="Id the engine gave the adapter."
    )
    uri: str | None = Field(
        default=None, max_length=URI_MAX_LENGTH, description="Source URI this state refers to."
    )
    sha256: str | None = Field(
        default=None,
        max_length=64,
        pattern=SHA256_PATTERN,
        description="Source digest this state refers to, if any.",
    )
    reason: Reason | None = Field(
        default=None, description="Why, as one CamelCase word (e.g. CapacityExceeded)."
    )
    message: Message | None = Field(default=None, description="What happened, what to do.")
    attempts: int = Field(
        default=0, ge=0, le=MAX_ATTEMPTS, description="Load attempts since the last success."
    )
    last_transition_time: Timestamp | None = Field(
        default=None, description="When state last changed."
    )


class LoRAAdapterStatus(StatusModel):
    """The observed state of a LoRAAdapter."""

    observed_generation: int | None = Field(
        default=None, ge=0, le=JSON_SAFE_INT_MAX, description="metadata.generation last acted upon."
    )
    adapter_name: ModelName | None = Field(
        default=None, description="The name the adapter is served under."
    )
    pods: list[AdapterPodStatus] = Field(
        default_factory=list,
        max_length=MAX_STATUS_PODS,
        description="Per targeted pod: state, reason, attempts.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["pod"]},
    )
    loaded_replicas: int = Field(
        default=0, ge=0, le=MAX_STATUS_PODS, description="Pods that serve the adapter."
    )
    target_replicas: int = Field(
        default=0, ge=0, le=MAX_STATUS_PODS, description="Pods that should serve it."
    )
    loaded: str | None = Field(
        default=None,
        max_length=24,
        pattern=r"^[0-9]+/[0-9]+$",
        description="loadedReplicas/targetReplicas, e.g. 3/4.",
    )
    conditions: list[Condition] = conditions_field()


class LoRAAdapter(Resource):
    """One LoRA adapter to load onto the live pods of a DynamoWorker."""

    info: ClassVar[ResourceInfo] = ResourceInfo(
        group=GROUP,
        version=VERSION,
        kind=KIND,
        plural=PLURAL,
        singular="loraadapter",
        short_names=("lora",),
        spec_model=LoRAAdapterSpec,
        status_model=LoRAAdapterStatus,
        description="LoRAAdapter loads one LoRA adapter onto the live pods of a DynamoWorker, "
        "without restarting them; deleting it unloads the adapter.",
        printer_columns=(
            PrinterColumn("Worker", "string", ".spec.workerRef.name", "The target DynamoWorker."),
            PrinterColumn("Loaded", "string", ".status.loaded", "Pods serving it / targeted."),
            condition_column("Ready", "Ready"),
            AGE_COLUMN,
            PrinterColumn("Adapter", "string", ".status.adapterName", "Name served.", 1),
            condition_column("Reason", "Ready", "reason", priority=1),
        ),
    )

    api_version: Literal["dynamo.dev/v1alpha1"] = "dynamo.dev/v1alpha1"
    kind: Literal["LoRAAdapter"] = "LoRAAdapter"
    spec: LoRAAdapterSpec
    status: LoRAAdapterStatus | None = None

    @property
    def adapter_name(self) -> str | None:
        """The name clients use: spec.adapterName, else metadata.name."""
        return self.spec.adapter_name or self.metadata.name
