"""Read-only views of `DynamoWorkerMetadata`, upstream Dynamo's per-pod discovery record.

Each worker pod writes one `DynamoWorkerMetadata` (nvidia.com/v1alpha1, named after the pod,
owned by the pod) whose `spec.data` is upstream's DiscoveryMetadata: four maps keyed by
discovery path (`endpoints`, `model_cards`, `event_channels`, `event_sources`), each value a
discovery instance tagged by `type`. The operator reads the model cards back into
`DynamoWorker.status`: served names, runtime config (context length, KV blocks, max seqs,
data-parallel layout, taints, `runtime_data.token_budget`) and one card per loaded adapter.

Field names are upstream's (snake_case JSON). Unknown fields are ignored and `null` maps and
lists read as empty, so records from newer or older upstream workers still parse.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

GROUP = "nvidia.com"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DynamoWorkerMetadata"
PLURAL = "dynamoworkermetadatas"
SINGULAR = "dynamoworkermetadata"
SHORT_NAME = "dwm"
TOKEN_BUDGET_KEY = "token_budget"
TOPOLOGY_TAINT_PREFIX = "dynamo.topology/"


def _none_as_empty_dict(value: Any) -> Any:
    return {} if value is None else value


def _none_as_empty_list(value: Any) -> Any:
    return [] if value is None else value


NullableDict = Annotated[dict[str, Any], BeforeValidator(_none_as_empty_dict)]
NullableStrList = Annotated[list[str], BeforeValidator(_none_as_empty_list)]


class View(BaseModel):
    """A frozen, tolerant view: unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class TokenBudgetView(View):
    """`runtime_data.token_budget` as the frontend reads it (u32 limit, flags default false)."""

    combined_limit: int = Field(ge=0, le=2**32 - 1)
    reject_prompt_overflow: bool = False
    reject_total_overflow: bool = False


class RuntimeConfig(View):
    """`card_json.runtime_config` (upstream's ModelRuntimeConfig); every field optional."""

    context_length: int | None = None
    total_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_size: int = 1
    taints: NullableStrList = Field(default_factory=list)
    runtime_data: NullableDict = Field(default_factory=dict)
    max_gpu_lora_count: int | None = None

    @property
    def token_budget(self) -> TokenBudgetView | None:
        """The published token budget; None when absent or invalid (the frontend ignores an
        invalid one too, so showing it would mislead)."""
        raw = self.runtime_data.get(TOKEN_BUDGET_KEY)
        if not isinstance(raw, dict):
            return None
        try:
            return TokenBudgetView.model_validate(raw)
        except ValidationError:
            return None

    @property
    def dp_ranks(self) -> list[int]:
        """Data-parallel ranks served: start to start + size - 1."""
        return list(
            range(
                self.data_parallel_start_rank,
                self.data_parallel_start_rank + self.data_parallel_size,
            )
        )

    @property
    def caller_taints(self) -> list[str]:
        """Taints set through `POST /engine/update/model_taints` (topology taints left out)."""
        return sorted(t for t in self.taints if not t.startswith(TOPOLOGY_TAINT_PREFIX))


class LoraInfo(View):
    """`card_json.lora`, present on an adapter's card."""

    name: str
    max_gpu_lora_count: int | None = None


class ModelDeploymentCard(View):
    """`card_json`: the parts the operator reads."""

    display_name: str
    slug: str = ""
    source_path: str | None = None
    context_length: int | None = None
    kv_cache_block_size: int | None = None
    model_type: str | None = None
    model_input: str | None = None
    worker_type: str | None = None
    lora: LoraInfo | None = None
    aliases: NullableStrList = Field(default_factory=list)
    runtime_config: Annotated[RuntimeConfig, BeforeValidator(_none_as_empty_dict)] = Field(
        default_factory=RuntimeConfig
    )


class EndpointRecord(View):
    """A `type: Endpoint` instance: where the worker serves an endpoint."""

    type: Literal["Endpoint"] = "Endpoint"
    namespace: str
    component: str
    endpoint: str
    instance_id: int
    transport: NullableDict = Field(default_factory=dict)
    device_type: str | None = None
    request_plane_codec: str | None = None


class ModelCardRecord(View):
    """A `type: Model` instance: a model card (a base model, or an adapter with model_suffix)."""

    type: Literal["Model"] = "Model"
    namespace: str
    component: str
    endpoint: str
    instance_id: int
    card_json: ModelDeploymentCard
    model_suffix: str | None = None

    @property
    def is_adapter(self) -> bool:
        """Whether this card is a LoRA adapter's (upstream sets both suffix and `lora`)."""
        return self.model_suffix is not None or self.card_json.lora is not None

    @property
    def served_name(self) -> str:
        """The name clients use for this card (an adapter's name for an adapter card)."""
        if self.card_json.lora is not None:
            return self.card_json.lora.name
        return self.card_json.display_name


class EventChannelRecord(View):
    """A `type: EventChannel` instance (a publisher's transport)."""

    type: Literal["EventChannel"] = "EventChannel"
    scope: NullableDict = Field(default_factory=dict)
    topic: str
    instance_id: int
    transport: NullableDict = Field(default_factory=dict)


class EventSourceRecord(View):
    """A `type: EventSource` instance (what a publisher's events are about)."""

    type: Literal["EventSource"] = "EventSource"
    scope: NullableDict = Field(default_factory=dict)
    topic: str
    publisher_id: int
    metadata: NullableDict = Field(default_factory=dict)


class DiscoveryMetadata(View):
    """`spec.data`: the four discovery maps (`null` reads as empty)."""

    endpoints: Annotated[dict[str, EndpointRecord], BeforeValidator(_none_as_empty_dict)] = Field(
        default_factory=dict
    )
    model_cards: Annotated[dict[str, ModelCardRecord], BeforeValidator(_none_as_empty_dict)] = (
        Field(default_factory=dict)
    )
    event_channels: Annotated[
        dict[str, EventChannelRecord], BeforeValidator(_none_as_empty_dict)
    ] = Field(default_factory=dict)
    event_sources: Annotated[dict[str, EventSourceRecord], BeforeValidator(_none_as_empty_dict)] = (
        Field(default_factory=dict)
    )

    def base_cards(self) -> list[ModelCardRecord]:
        """Cards of base models, in key order."""
        return [card for _, card in sorted(self.model_cards.items()) if not card.is_adapter]

    def adapter_cards(self) -> list[ModelCardRecord]:
        """Cards of loaded LoRA adapters, in key order."""
        return [card for _, card in sorted(self.model_cards.items()) if card.is_adapter]


class MetadataObjectMeta(View):
    """The metadata fields the operator reads from a DynamoWorkerMetadata."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    name: str
    namespace: str | None = None
    uid: str | None = None
    owner_references: Annotated[list[dict[str, Any]], BeforeValidator(_none_as_empty_list)] = Field(
        default_factory=list, alias="ownerReferences"
    )


class DynamoWorkerMetadataSpec(View):
    """`spec` of a DynamoWorkerMetadata."""

    data: Annotated[DiscoveryMetadata, BeforeValidator(_none_as_empty_dict)] = Field(
        default_factory=DiscoveryMetadata
    )


class DynamoWorkerMetadata(View):
    """One pod's discovery record, with the facts the operator shows in status."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    api_version: str = Field(default=API_VERSION, alias="apiVersion")
    kind: str = KIND
    metadata: MetadataObjectMeta
    spec: DynamoWorkerMetadataSpec = Field(default_factory=DynamoWorkerMetadataSpec)

    @property
    def pod_name(self) -> str:
        """The pod the record belongs to (the record is named after it)."""
        return self.metadata.name

    @property
    def base_card(self) -> ModelCardRecord | None:
        """The base model's card (the first by key when a worker serves several)."""
        cards = self.spec.data.base_cards()
        return cards[0] if cards else None

    @property
    def served_model_names(self) -> list[str]:
        """Base model names served, with their aliases, sorted."""
        names = set()
        for card in self.spec.data.base_cards():
            names.add(card.served_name)
            names.update(card.card_json.aliases)
        return sorted(names)

    @property
    def loaded_adapters(self) -> list[str]:
        """Names of the LoRA adapters the pod serves, sorted."""
        return sorted({card.served_name for card in self.spec.data.adapter_cards()})

    @property
    def runtime_config(self) -> RuntimeConfig | None:
        """The base card's runtime config."""
        card = self.base_card
        return card.card_json.runtime_config if card is not None else None

    @property
    def token_budget(self) -> TokenBudgetView | None:
        """The token budget the pod published, if any."""
        config = self.runtime_config
        return config.token_budget if config is not None else None

    @property
    def taints(self) -> list[str]:
        """Every routing taint of the base card (topology ones included), sorted."""
        config = self.runtime_config
        return sorted(config.taints) if config is not None else []

    @property
    def dp_ranks(self) -> list[int]:
        """Data-parallel ranks the pod serves."""
        config = self.runtime_config
        return config.dp_ranks if config is not None else []
