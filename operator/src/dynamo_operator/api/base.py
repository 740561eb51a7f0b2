"""The base of every API model: camelCase JSON, snake_case Python, CEL rules mirrored in Python.

A CEL rule lives twice: as an `x-kubernetes-validations` entry that the API server evaluates,
and as a Python predicate evaluated when a model is validated here. Both halves are declared
together in one `Rule`, with one message, so the operator, the unit tests and the API server
refuse the same objects with the same words.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.alias_generators import to_camel


@dataclass(frozen=True)
class Rule:
    """One `x-kubernetes-validations` entry of an object schema, with its Python mirror.

    `rule` is the CEL expression (`self` is the object the rule sits on). `check` evaluates
    the same condition on the validated Python model; transition rules (they read `oldSelf`)
    have none, since a single object has no previous version. `field_path` (relative to the
    object, e.g. `.placement.replicas`) makes the API server report the error on that field.
    """

    rule: str
    message: str
    check: Callable[[Any], bool] | None = None
    field_path: str | None = None
    reason: str | None = None

    def to_schema(self) -> dict[str, str]:
        """The rule as the CRD schema spells it."""
        entry = {"rule": self.rule, "message": self.message}
        if self.field_path is not None:
            entry["fieldPath"] = self.field_path
        if self.reason is not None:
            entry["reason"] = self.reason
        return entry


def _add_cel_rules(schema: dict[str, Any], cls: type[Any]) -> None:
    """Pydantic hook: put the model's own CEL rules into its JSON schema."""
    rules: tuple[Rule, ...] = cls.__dict__.get("cel_rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [rule.to_schema() for rule in rules]


class ApiModel(BaseModel):
    """A part of a custom resource: camelCase on the wire, snake_case in Python.

    Unknown fields are refused. The CRD and the operator are generated from the same models
    and ship together, and the API server prunes fields the schema does not know, so an
    unknown field here is either a typo in a manifest or a CRD/operator version skew; both
    should fail loudly rather than silently drop a setting.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        json_schema_extra=_add_cel_rules,
    )

    cel_rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_cel_rules(self) -> Self:
        failed = [
            rule.message
            for rule in type(self).__dict__.get("cel_rules", ())
            if rule.check is not None and not rule.check(self)
        ]
        if failed:
            raise ValueError("; ".join(failed))
        return self

    def to_dict(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase keys, unset fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class StatusModel(ApiModel):
    """A part of a status. Written only by the operator; unknown fields are ignored so that an
    older operator can still read the status a newer one wrote (it rewrites it anyway)."""

    model_config = ConfigDict(extra="ignore")
