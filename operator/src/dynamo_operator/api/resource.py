"""A custom resource as a whole: object metadata, and what the CRD says about the kind."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from dynamo_operator.api.base import ApiModel


class ObjectMeta(BaseModel):
    """The parts of metadata the operator reads. Everything else is ignored."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    name: str | None = None
    generate_name: str | None = None
    namespace: str | None = None
    uid: str | None = None
    resource_version: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    finalizers: list[str] = Field(default_factory=list)
    owner_references: list[dict[str, Any]] = Field(default_factory=list)
    creation_timestamp: str | None = None
    deletion_timestamp: str | None = None


@dataclass(frozen=True)
class PrinterColumn:
    """A column of `kubectl get` (priority 1: only with `-o wide`)."""

    name: str
    type: str
    json_path: str
    description: str
    priority: int = 0

    def to_schema(self) -> dict[str, Any]:
        column: dict[str, Any] = {
            "name": self.name,
            "type": self.type,
            "jsonPath": self.json_path,
            "description": self.description,
        }
        if self.priority:
            column["priority"] = self.priority
        return column


def condition_column(
    name: str, condition: str, field: str = "status", priority: int = 0
) -> PrinterColumn:
    """A column showing one field of one condition."""
    return PrinterColumn(
        name=name,
        type="string",
        json_path=f'.status.conditions[?(@.type=="{condition}")].{field}',
        description=f"The {condition} condition's {field}.",
        priority=priority,
    )


AGE_COLUMN = PrinterColumn(
    name="Age", type="date", json_path=".metadata.creationTimestamp", description="Age."
)


@dataclass(frozen=True)
class ScaleSubresource:
    """Paths of the scale subresource (`kubectl scale`, HorizontalPodAutoscaler)."""

    spec_replicas_path: str
    status_replicas_path: str
    label_selector_path: str


@dataclass(frozen=True)
class ResourceInfo:
    """What the CRD says about a kind beyond its schema."""

    group: str
    version: str
    kind: str
    plural: str
    singular: str
    short_names: tuple[str, ...]
    spec_model: type[ApiModel]
    status_model: type[ApiModel]
    description: str
    printer_columns: tuple[PrinterColumn, ...] = ()
    scale: ScaleSubresource | None = None
    categories: tuple[str, ...] = ("dynamo",)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{self.group}"


class Resource(ApiModel):
    """A whole custom resource as read from the API server: apiVersion, kind, metadata, spec,
    status. Subclasses fix `info`, the literal apiVersion/kind, and the spec/status types.
    Their own `cel_rules` sit at the root of the CRD schema (where `self.metadata.name` can
    be checked)."""

    model_config = ConfigDict(extra="ignore")

    info: ClassVar[ResourceInfo]

    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
