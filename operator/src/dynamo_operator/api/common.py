"""Field types shared by the kinds: names, quantities, timestamps, selectors, conditions.

Every string type carries a maximum length and every number a range: the API server sizes
the cost of CEL rules from these bounds, and refuses a CRD whose rules could cost too much.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    Field,
    PlainSerializer,
    StringConstraints,
    WithJsonSchema,
)

from dynamo_operator.api.base import ApiModel, Rule, StatusModel

GROUP = "dynamo.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# The API server reads schema bounds as float64: 2**63 - 1 is not exact there and is refused.
# Counters such as generations stay far below 2**53 - 1, the largest exact integer.
JSON_SAFE_INT_MAX = 2**53 - 1
UINT32_MAX = 2**32 - 1
# Worker pods of one DynamoWorker at most.
MAX_REPLICAS = 1024

# Kubernetes name shapes (apimachinery's validation, as regular expressions that RE2 and
# Python's `re` read the same way).
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_SUBDOMAIN_MAX = 253
DNS_LABEL_MAX = 63
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
# A model name as clients send it in the `model` field: Hugging Face ids (`org/repo`), tags
# (`name:tag`) and versions (`name.v2`) all fit; whitespace and control characters do not.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/+-]*$"
MODEL_NAME_MAX = 256
# metav1.Condition's `type` shape.
CONDITION_TYPE_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)
# Reasons are CamelCase words (API conventions); stricter than metav1 so that a snake_case or
# free-text reason written by mistake is refused rather than shown to users.
REASON_PATTERN = r"^[A-Z][A-Za-z0-9]*$"
REASON_MAX = 1024
MESSAGE_MAX = 32768

DnsSubdomain = Annotated[
    str,
    StringConstraints(min_length=1, max_length=DNS_SUBDOMAIN_MAX, pattern=DNS_SUBDOMAIN_PATTERN),
]
LabelValue = Annotated[
    str, StringConstraints(max_length=DNS_LABEL_MAX, pattern=LABEL_VALUE_PATTERN)
]
ModelName = Annotated[
    str, StringConstraints(min_length=1, max_length=MODEL_NAME_MAX, pattern=MODEL_NAME_PATTERN)
]
Reason = Annotated[
    str, StringConstraints(min_length=1, max_length=REASON_MAX, pattern=REASON_PATTERN)
]
Message = Annotated[str, StringConstraints(max_length=MESSAGE_MAX)]

# resource.Quantity, non-negative (no sign): "4", "500m", "16Gi", "1e3".
QUANTITY_PATTERN = (
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
QUANTITY_MAX_LENGTH = 64
_QUANTITY = re.compile(QUANTITY_PATTERN)


def _check_quantity(value: int | str) -> int | str:
    if isinstance(value, bool):
        raise ValueError("a quantity is a number or a string such as '500m' or '16Gi'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a quantity must not be negative")
        return value
    if len(value) > QUANTITY_MAX_LENGTH or not _QUANTITY.match(value):
        raise ValueError(f"{value!r} is not a quantity (e.g. 4, '500m', '16Gi')")
    return value


# Kubernetes writes quantities as int-or-string: `cpu: 4` and `memory: 16Gi` both parse.
Quantity = Annotated[
    int | str,
    AfterValidator(_check_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "x-kubernetes-int-or-string": True,
            "pattern": QUANTITY_PATTERN,
            "maxLength": QUANTITY_MAX_LENGTH,
        }
    ),
]


def format_timestamp(value: datetime) -> str:
    """RFC 3339 in UTC at second precision, as metav1.Time is written."""
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


Timestamp = Annotated[
    AwareDatetime,
    PlainSerializer(format_timestamp, return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "format": "date-time", "maxLength": 64}),
]


def cel_string(value: str) -> str:
    """A CEL string literal. Our literals never need escapes; refuse any that would."""
    if "'" in value or "\\" in value:
        raise ValueError(f"CEL literal needs escaping: {value!r}")
    return f"'{value}'"


class SecretKeyRef(ApiModel):
    """A key of a Secret in the object's namespace. Only the reference is stored; the value
    reaches the pod through the kubelet and is never copied by the operator."""

    name: DnsSubdomain = Field(description="Name of the Secret, in the same namespace.")
    key: str = Field(
        min_length=1,
        max_length=DNS_SUBDOMAIN_MAX,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="Key within the Secret's data.",
    )
    optional: bool | None = Field(
        default=None, description="Start the pod even when the Secret or key does not exist."
    )


class LabelSelectorRequirement(ApiModel):
    """One expression of a label selector."""

    key: str = Field(min_length=1, max_length=317, description="The label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="How the key relates to the values."
    )
    values: list[LabelValue] = Field(
        default_factory=list,
        max_length=64,
        description="Values for In and NotIn; empty for Exists and DoesNotExist.",
        json_schema_extra={"x-kubernetes-list-type": "atomic"},
    )

    cel_rules = (
        Rule(
            rule="self.operator in ['In', 'NotIn'] ? (has(self.values) && size(self.values) > 0)"
            " : (!has(self.values) || size(self.values) == 0)",
            message="matchExpressions[].values: In and NotIn need values; "
            "Exists and DoesNotExist take none",
            check=lambda r: (len(r.values) > 0) == (r.operator in ("In", "NotIn")),
        ),
    )


class LabelSelector(ApiModel):
    """A label selector, as in Deployments and Services (all terms must match)."""

    match_labels: dict[str, LabelValue] = Field(
        default_factory=dict, max_length=32, description="Labels that must all be present."
    )
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list,
        max_length=16,
        description="Expressions that must all hold.",
        json_schema_extra={"x-kubernetes-list-type": "atomic"},
    )


ConditionStatus = Literal["True", "False", "Unknown"]


class ConditionType(StrEnum):
    """The condition types both kinds report."""

    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    # DynamoWorker only, with spec.model.cache: the weights are in the cache volume.
    MODEL_CACHED = "ModelCached"


class Condition(StatusModel):
    """An observation of one aspect of the object (Kubernetes API conventions)."""

    type: str = Field(
        min_length=1,
        max_length=316,
        pattern=CONDITION_TYPE_PATTERN,
        description="Aspect observed: Ready, Progressing or Degraded.",
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: Reason = Field(description="Why the condition has this status, as one CamelCase word.")
    message: Message = Field(default="", description="What happened, and what to do about it.")
    observed_generation: int | None = Field(
        default=None,
        ge=0,
        le=JSON_SAFE_INT_MAX,
        description="metadata.generation of the spec this condition was computed from.",
    )
    last_transition_time: Timestamp = Field(
        description="When status last changed (reason and message changes keep it)."
    )


def conditions_field() -> Any:
    """The `status.conditions` field: a list keyed by type (so server-side apply merges it)."""
    return Field(
        default_factory=list,
        max_length=8,
        description="Ready, Progressing and Degraded, per the Kubernetes API conventions.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


def defaulted(factory: Callable[[], ApiModel], description: str) -> Any:
    """A sub-object that is always present: absent in a manifest, the API server fills in the
    same defaults as the Python default factory. The schema default is the whole defaulted
    object, not `{}`: the API server checks a default against the CEL rules as written,
    without filling in the nested defaults first."""
    return Field(
        default_factory=factory,
        description=description,
        json_schema_extra={"default": factory().to_dict()},
    )
