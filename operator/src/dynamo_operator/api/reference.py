"""The CRD reference (docs/crd-reference.md), rendered from the generated CRD schemas.

It walks the same `openAPIV3Schema` the CRDs carry, so the reference cannot say anything the
API server does not enforce: for each kind, one table per object level (field path, type,
default, bounds or enum, description) followed by the messages of that level's CEL rules.
`hack/gen-crds` writes it next to the CRDs and `hack/gen-crds --check` fails while it is stale.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamo_operator.api.crd import RESOURCES, openapi_schema
from dynamo_operator.api.resource import Resource

REFERENCE_PATH = Path("docs") / "crd-reference.md"
HEADER = "<!-- Generated from operator/src/dynamo_operator/api by hack/gen-crds; do not edit. -->\n"
TABLE_HEAD = (
    "| Field | Type | Default | Bounds / enum | Description |\n| --- | --- | --- | --- | --- |\n"
)


@dataclass(frozen=True)
class Level:
    """One object of a schema: its dotted path (empty at the root) and its schema."""

    path: str
    schema: Mapping[str, Any]


def _cell(text: str) -> str:
    """Text fit for one table cell: one line, pipes escaped (GFM splits cells on `|` even
    inside code spans unless it is escaped)."""
    return " ".join(text.split()).replace("|", "\\|")


def _code(value: Any) -> str:
    """A value as inline code, JSON-spelled so strings, numbers and lists read unambiguously."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    # A backtick inside would end the span early; a longer fence keeps it literal.
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _is_object(schema: Mapping[str, Any]) -> bool:
    return schema.get("type") == "object" and "properties" in schema


def _element(schema: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]] | None:
    """(path suffix, schema) of the object an array or map holds, when it holds objects."""
    items = schema.get("items")
    if schema.get("type") == "array" and isinstance(items, Mapping) and _is_object(items):
        return "[]", items
    extra = schema.get("additionalProperties")
    if schema.get("type") == "object" and isinstance(extra, Mapping) and _is_object(extra):
        return ".<key>", extra
    return None


def type_name(schema: Mapping[str, Any]) -> str:
    """A field's type in words: `string`, `[]object`, `map[string]string`, `int-or-string`..."""
    if schema.get("x-kubernetes-int-or-string"):
        return "int-or-string"
    kind = str(schema.get("type", "any"))
    if kind == "array":
        items = schema.get("items")
        return "[]" + (type_name(items) if isinstance(items, Mapping) else "any")
    if kind == "object":
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            return f"map[string]{type_name(extra)}"
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return "object (free-form)"
    if "format" in schema:
        return f"{kind} ({schema['format']})"
    return kind


def _range(low: Any, high: Any, unit: str) -> str:
    if low is not None and high is not None:
        return f"{low}..{high}{unit}"
    if high is not None:
        return f"at most {high}{unit}"
    return f"at least {low}{unit}"


def bounds(schema: Mapping[str, Any]) -> list[str]:
    """What the API server checks on a field's value besides its type."""
    out: list[str] = []
    if "enum" in schema:
        out.append("one of " + ", ".join(_code(v) for v in schema["enum"]))
    if "minimum" in schema or "maximum" in schema:
        out.append(_range(schema.get("minimum"), schema.get("maximum"), ""))
    # An enum's length bound is derived from its values (see `crd`): nothing to add.
    if "enum" not in schema and ("minLength" in schema or "maxLength" in schema):
        out.append(_range(schema.get("minLength"), schema.get("maxLength"), " characters"))
    if "minItems" in schema or "maxItems" in schema:
        out.append(_range(schema.get("minItems"), schema.get("maxItems"), " items"))
    if "maxProperties" in schema:
        out.append(f"at most {schema['maxProperties']} entries")
    if "pattern" in schema:
        out.append("pattern " + _code(schema["pattern"]))
    list_type = schema.get("x-kubernetes-list-type")
    if list_type == "map":
        keys = ", ".join(_code(k) for k in schema.get("x-kubernetes-list-map-keys", []))
        out.append(f"list map keyed by {keys}")
    elif list_type == "set":
        out.append("no duplicates")
    for what, inner in (
        ("each item", schema.get("items")),
        ("each value", schema.get("additionalProperties")),
    ):
        if isinstance(inner, Mapping) and not _is_object(inner) and (inner_bounds := bounds(inner)):
            out.append(f"{what}: " + ", ".join(inner_bounds))
    return out


def levels(schema: Mapping[str, Any], path: str) -> Iterator[Level]:
    """Every object level under `schema` (itself first), depth first in field order."""
    yield Level(path, schema)
    for name, sub in schema.get("properties", {}).items():
        child = f"{path}.{name}" if path else name
        if _is_object(sub):
            yield from levels(sub, child)
        elif (element := _element(sub)) is not None:
            suffix, inner = element
            yield from levels(inner, child + suffix)


def _row(path: str, name: str, sub: Mapping[str, Any], required: bool) -> str:
    kind = type_name(sub) + (", required" if required else "")
    default = _code(sub["default"]) if "default" in sub else ""
    cells = [
        _code(f"{path}.{name}" if path else name),
        kind,
        default,
        "; ".join(bounds(sub)),
        sub.get("description", ""),
    ]
    return "| " + " | ".join(_cell(c) for c in cells) + " |\n"


def _rules(schema: Mapping[str, Any], path: str) -> str:
    rules = schema.get("x-kubernetes-validations") or []
    if not rules:
        return ""
    lines = ["\nRules checked by the API server on admission:\n\n"]
    for rule in rules:
        message = " ".join(str(rule["message"]).split())
        where = rule.get("fieldPath")
        on = f" (reported on {_code(path + where)})" if where else ""
        lines.append(f"- {message}{on}\n")
    return "".join(lines)


def render_level(level: Level, kind: str) -> str:
    """One object level: heading, description, field table, CEL rule messages."""
    schema = level.schema
    # The kind in every heading keeps anchors unique (both kinds have spec and status).
    title = f"{kind} `{level.path}`" if level.path else f"{kind} top level"
    parts = [f"### {title}\n\n"]
    if level.path and schema.get("description"):
        parts.append(" ".join(str(schema["description"]).split()) + "\n\n")
    required = set(schema.get("required", []))
    parts.append(TABLE_HEAD)
    for name, sub in schema.get("properties", {}).items():
        parts.append(_row(level.path, name, sub, name in required))
    parts.append(_rules(schema, level.path))
    return "".join(parts)


def render_kind(resource: type[Resource]) -> str:
    """The reference section of one kind."""
    info = resource.info
    schema = openapi_schema(resource)
    short = ", ".join(f"`{s}`" for s in info.short_names)
    parts = [
        f"## {info.kind}\n\n",
        f"`apiVersion: {info.group}/{info.version}`, `kind: {info.kind}`, plural "
        f"`{info.plural}`" + (f", short names {short}" if short else "") + ".\n\n",
        " ".join(str(schema["description"]).split()) + "\n",
    ]
    parts += ["\n" + render_level(level, info.kind) for level in levels(schema, "")]
    return "".join(parts)


def crd_reference() -> str:
    """docs/crd-reference.md: every kind's section, in the order of `RESOURCES`."""
    intro = (
        "# CRD reference\n\n"
        "Every field of the operator's custom resources, read from the CRDs' OpenAPI schemas "
        "(`crds/`). Types, defaults, bounds and rules are what the API server enforces on "
        "admission. Run `hack/gen-crds` after changing a model in "
        "`operator/src/dynamo_operator/api`.\n"
    )
    kinds = "".join(f"- [{r.info.kind}](#{r.info.kind.lower()})\n" for r in RESOURCES)
    return HEADER + intro + "\n" + kinds + "".join("\n" + render_kind(r) for r in RESOURCES)


def write_reference(path: Path) -> Path:
    """Write the reference to `path` (its folder is created); returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(crd_reference())
    return path


def reference_is_stale(path: Path) -> bool:
    """Whether the file at `path` is missing or differs from what the models render."""
    return not path.is_file() or path.read_text() != crd_reference()
