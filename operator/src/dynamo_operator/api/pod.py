"""What a user may add to the worker pods: scheduling, labels, annotations and extra env.

Small Kubernetes types (tolerations, env) are typed so the API server checks them on apply;
affinity keeps Kubernetes' own schema (it would add hundreds of lines to the CRD) and is
checked when the Deployment is applied.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, field_validator

from dynamo_operator.api.base import ApiModel, Rule
from dynamo_operator.api.common import (
    DNS_SUBDOMAIN_MAX,
    DnsSubdomain,
    LabelValue,
    Quantity,
    SecretKeyRef,
)

# Label and annotation keys the operator owns: it selects its pods and wires discovery with
# them, so a pod override must not set them.
RESERVED_LABEL_PREFIXES = ("dynamo.dev/", "nvidia.com/dynamo-")
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
EnvName = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=ENV_NAME_PATTERN)]
AnnotationValue = Annotated[str, StringConstraints(max_length=8192)]


class Toleration(ApiModel):
    """Lets the worker pods schedule onto nodes with a matching taint."""

    key: str | None = Field(
        default=None, max_length=317, description="Taint key; empty with Exists matches all."
    )
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Equal (the default) or Exists."
    )
    value: str | None = Field(
        default=None, max_length=63, description="Taint value to match with Equal."
    )
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        default=None,
        ge=0,
        le=31536000,
        description="How long a NoExecute taint is tolerated before eviction.",
    )

    cel_rules = (
        Rule(
            rule="!has(self.operator) || self.operator != 'Exists' || !has(self.value)"
            " || self.value == ''",
            message="tolerations[].value must be empty when operator is Exists",
            check=lambda t: t.operator != "Exists" or not t.value,
        ),
        Rule(
            rule="(has(self.key) && self.key != '')"
            " || (has(self.operator) && self.operator == 'Exists')",
            message="tolerations[]: an empty key needs operator: Exists",
            check=lambda t: bool(t.key) or t.operator == "Exists",
        ),
        Rule(
            rule="!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
            message="tolerations[].tolerationSeconds needs effect: NoExecute",
            check=lambda t: t.toleration_seconds is None or t.effect == "NoExecute",
        ),
    )


class ConfigMapKeyRef(ApiModel):
    """A key of a ConfigMap in the object's namespace."""

    name: DnsSubdomain = Field(description="Name of the ConfigMap, in the same namespace.")
    key: str = Field(
        min_length=1,
        max_length=DNS_SUBDOMAIN_MAX,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="Key within the ConfigMap's data.",
    )
    optional: bool | None = Field(
        default=None, description="Start the pod even when the ConfigMap or key does not exist."
    )


class FieldRef(ApiModel):
    """A field of the pod (downward API)."""

    field_path: str = Field(
        min_length=1, max_length=256, description="Path of the field, e.g. metadata.labels['x']."
    )
    api_version: str | None = Field(
        default=None, max_length=64, description="Version of the schema the path is written in."
    )


class ResourceFieldRef(ApiModel):
    """A resource request or limit of the container (downward API)."""

    resource: str = Field(
        min_length=1, max_length=64, description="The resource, e.g. limits.memory."
    )
    container_name: str | None = Field(
        default=None,
        max_length=63,
        description="Container to read; the worker container by default.",
    )
    divisor: Quantity | None = Field(default=None, description="Unit the value is divided by.")


class EnvVarSource(ApiModel):
    """Where an environment variable's value comes from (exactly one source)."""

    secret_key_ref: SecretKeyRef | None = Field(default=None, description="A key of a Secret.")
    config_map_key_ref: ConfigMapKeyRef | None = Field(
        default=None, description="A key of a ConfigMap."
    )
    field_ref: FieldRef | None = Field(default=None, description="A field of the pod.")
    resource_field_ref: ResourceFieldRef | None = Field(
        default=None, description="A resource request or limit of the container."
    )

    cel_rules = (
        Rule(
            rule="[has(self.secretKeyRef), has(self.configMapKeyRef), has(self.fieldRef),"
            " has(self.resourceFieldRef)].filter(x, x).size() == 1",
            message="env[].valueFrom: set exactly one of secretKeyRef, configMapKeyRef,"
            " fieldRef or resourceFieldRef",
            check=lambda s: (
                [
                    s.secret_key_ref,
                    s.config_map_key_ref,
                    s.field_ref,
                    s.resource_field_ref,
                ].count(None)
                == 3
            ),
        ),
    )


class EnvVar(ApiModel):
    """An extra environment variable for the worker container."""

    name: EnvName = Field(description="Variable name.")
    value: str | None = Field(default=None, max_length=32768, description="Literal value.")
    value_from: EnvVarSource | None = Field(
        default=None, description="Take the value from a Secret, ConfigMap or the pod."
    )

    cel_rules = (
        Rule(
            rule="!(has(self.value) && has(self.valueFrom))",
            message="env[]: set value or valueFrom, not both",
            check=lambda e: e.value is None or e.value_from is None,
        ),
    )


def _no_reserved_keys(field: str) -> Rule:
    prefixes = " || ".join(f"k.startsWith('{p}')" for p in RESERVED_LABEL_PREFIXES)
    return Rule(
        rule=f"!has(self.{field}) || self.{field}.all(k, !({prefixes}))",
        message=f"{field}: keys under dynamo.dev/ and nvidia.com/dynamo- are set by the"
        " operator; use another prefix",
        check=lambda p: (
            not any(key.startswith(RESERVED_LABEL_PREFIXES) for key in getattr(p, field))
        ),
        field_path=f".{field}",
    )


class PodOverrides(ApiModel):
    """Additions to the pods (spec.pod: the worker pods; spec.frontend.pod: the frontend pods).
    The operator's own settings (probes, ports, security context, its labels and env) are not
    overridable here. Messages name the field relative to the pod block: the API server
    prefixes the full path."""

    node_selector: dict[str, LabelValue] = Field(
        default_factory=dict, max_length=32, description="Node labels the pods must land on."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=32,
        description="Taints the pods tolerate.",
        json_schema_extra={"x-kubernetes-list-type": "atomic"},
    )
    affinity: dict[str, Any] | None = Field(
        default=None,
        description="Kubernetes pod affinity (nodeAffinity, podAffinity, podAntiAffinity), "
        "checked by the API server when the Deployment is applied.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    priority_class_name: DnsSubdomain | None = Field(
        default=None, description="PriorityClass of the pods."
    )
    labels: dict[str, LabelValue] = Field(
        default_factory=dict, max_length=32, description="Extra labels on the pods."
    )
    annotations: dict[str, AnnotationValue] = Field(
        default_factory=dict, max_length=32, description="Extra annotations on the pods."
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=64,
        description="Extra environment variables of the main container.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )

    cel_rules = (_no_reserved_keys("labels"), _no_reserved_keys("annotations"))

    @field_validator("env")
    @classmethod
    def _unique_env_names(cls, env: list[EnvVar]) -> list[EnvVar]:
        # The API server refuses duplicate keys in a list of type map; do the same here.
        names = [e.name for e in env]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"env: duplicate names {duplicates}")
        return env
