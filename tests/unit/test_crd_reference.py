"""docs/crd-reference.md: generated from the CRD schemas, current, and complete."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from dynamo_operator.api import crd, reference
from dynamo_operator.api.dynamoworker import DynamoWorker
from dynamo_operator.api.loraadapter import LoRAAdapter

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / reference.REFERENCE_PATH


def _field_paths(schema: Mapping[str, Any], path: str) -> Iterator[str]:
    """Every field path under `schema`, walked independently of the module under test."""
    for name, sub in schema.get("properties", {}).items():
        child = f"{path}.{name}"
        yield child
        yield from _field_paths(sub, child)
        if isinstance(sub.get("items"), Mapping):
            yield from _field_paths(sub["items"], child + "[]")


def test_checked_in_reference_is_current() -> None:
    assert DOC.is_file(), "docs/crd-reference.md is missing: run hack/gen-crds"
    assert DOC.read_text() == reference.crd_reference(), (
        "docs/crd-reference.md is stale: run hack/gen-crds"
    )


@pytest.mark.parametrize("resource", [DynamoWorker, LoRAAdapter])
def test_every_spec_field_is_documented(resource: type[DynamoWorker] | type[LoRAAdapter]) -> None:
    text = DOC.read_text()
    spec = crd.openapi_schema(resource)["properties"]["spec"]
    paths = list(_field_paths(spec, "spec"))
    assert len(paths) > 10
    missing = [p for p in paths if f"| `{p}` |" not in text]
    assert not missing, f"{resource.info.kind} fields missing from the reference: {missing}"


def test_every_cel_message_is_documented() -> None:
    text = reference.crd_reference()
    messages: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, Mapping):
            messages.extend(r["message"] for r in node.get("x-kubernetes-validations", []))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for resource in crd.RESOURCES:
        walk(crd.openapi_schema(resource))
    assert len(messages) >= 10
    assert [m for m in messages if " ".join(m.split()) not in text] == []


def test_tables_keep_their_columns_when_patterns_hold_pipes() -> None:
    schema = {
        "type": "object",
        "properties": {
            "size": {
                "type": "string",
                "description": "A size | with a pipe.",
                "pattern": "^(a|b)$",
                "default": "a",
            },
            "count": {"type": "integer", "minimum": 1, "maximum": 8},
            "names": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 9}},
        },
        "required": ["size"],
        "x-kubernetes-validations": [{"rule": "true", "message": "x must hold", "fieldPath": ".x"}],
    }
    text = reference.render_level(reference.Level("spec", schema), "Thing")
    rows = [line for line in text.splitlines() if line.startswith("| `spec.")]
    assert len(rows) == 3
    for row in rows:
        # Five cells: six unescaped pipes.
        assert row.replace("\\|", "").count("|") == 6, row
    assert "pattern `^(a\\|b)$`" in rows[0]
    assert "string, required" in rows[0]
    assert "`a`" in rows[0]
    assert "1..8" in rows[1]
    assert "at most 4 items; each item: at most 9 characters" in rows[2]
    assert "- x must hold (reported on `spec.x`)" in text
    assert text.startswith("### Thing `spec`\n")


def test_check_mode_fails_on_a_stale_reference(tmp_path: Path) -> None:
    crds, chart = tmp_path / "crds", tmp_path / "chart"
    doc = tmp_path / "docs" / "crd-reference.md"
    assert crd.main([str(crds), "--chart", str(chart), "--reference", str(doc)]) == 0
    assert doc.read_text() == reference.crd_reference()
    args = ["--check", str(crds), "--chart", str(chart), "--reference", str(doc)]
    assert crd.main(args) == 0
    doc.write_text(doc.read_text().replace("| `spec.replicas` |", "| `spec.replica` |"))
    assert crd.main(args) == 1
    doc.unlink()
    assert crd.main(args) == 1
