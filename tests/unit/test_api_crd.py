"""CRD generation: deterministic, checked in, structural, and bounded everywhere (every field
described, every string, list and map bounded) so CEL cost stays within the API server's
limits and `kubectl explain` documents every field."""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, Field

from dynamo_operator import cli
from dynamo_operator.api import crd
from dynamo_operator.api.crd import NotStructuralError, structural_schema

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
OURS = [crd.custom_resource_definition(r) for r in crd.RESOURCES]


def schema_of(definition: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = definition["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return result


def walk(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node under `node` with its path (`[]` for items, `{}` for map values)."""
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}")
    if "items" in node:
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


def user_nodes() -> Iterator[tuple[str, dict[str, Any]]]:
    for definition in OURS:
        kind = definition["spec"]["names"]["kind"]
        root = schema_of(definition)
        for part in ("spec", "status"):
            yield from walk(root["properties"][part], f"{kind}.{part}")


def is_int_or_string(node: dict[str, Any]) -> bool:
    return bool(node.get("x-kubernetes-int-or-string"))


def test_generation_is_deterministic() -> None:
    assert crd.crd_files() == crd.crd_files()
    # Models imported in another order or rebuilt give the same bytes: nothing depends on
    # dict iteration of runtime state, only on the models.
    first = crd.render(crd.custom_resource_definition(crd.LoRAAdapter))
    assert first == crd.crd_files()["dynamo.dev_loraadapters.yaml"]


def test_checked_in_crds_are_current() -> None:
    stale = crd.stale_files(REPO / "crds")
    assert not stale, f"crds/ is stale ({', '.join(stale)}): run hack/gen-crds"


def test_checked_in_crds_parse_back_to_the_generated_manifests() -> None:
    for name, text in crd.crd_files().items():
        parsed = yaml.safe_load((REPO / "crds" / name).read_text())
        assert parsed == yaml.safe_load(text)


def test_every_field_is_described() -> None:
    missing = [
        f"{path}.{name}"
        for path, node in user_nodes()
        for name, sub in node.get("properties", {}).items()
        if not sub.get("description")
    ]
    assert not missing, missing


def test_every_string_list_and_map_is_bounded() -> None:
    unbounded = []
    for path, node in user_nodes():
        kind = node.get("type")
        if (kind == "string" or is_int_or_string(node)) and "maxLength" not in node:
            unbounded.append(f"{path}: string without maxLength")
        if kind == "array" and "maxItems" not in node:
            unbounded.append(f"{path}: array without maxItems")
        if isinstance(node.get("additionalProperties"), dict) and "maxProperties" not in node:
            unbounded.append(f"{path}: map without maxProperties")
        if kind in ("integer", "number") and not {"minimum", "maximum"} <= node.keys():
            unbounded.append(f"{path}: number without minimum and maximum")
        for bound in ("minimum", "maximum"):
            # The API server holds bounds as float64; larger integers are not exact there.
            if abs(node.get(bound, 0)) > 2**53 - 1:
                unbounded.append(f"{path}: {bound} beyond 2**53 - 1")
    assert not unbounded, unbounded


def test_schemas_are_structural() -> None:
    for path, node in user_nodes():
        preserved = node.get("x-kubernetes-preserve-unknown-fields")
        assert "type" in node or is_int_or_string(node) or preserved, f"{path}: no type"
        assert "title" not in node, path
        assert "$ref" not in node, path
        assert "anyOf" not in node or is_int_or_string(node), f"{path}: anyOf"
        assert not ({"properties", "additionalProperties"} <= node.keys()), path
        assert "uniqueItems" not in node, path
        assert "nullable" not in node, path
        if "x-kubernetes-list-type" in node:
            assert node["type"] == "array", path
            if node["x-kubernetes-list-type"] == "map":
                keys = node["x-kubernetes-list-map-keys"]
                assert set(keys) <= set(node["items"].get("required", [])), path


def test_every_list_says_how_apply_merges_it_when_it_holds_objects() -> None:
    # Server-side apply needs list types to merge per key; lists of objects must say so.
    for path, node in user_nodes():
        if node.get("type") == "array" and node["items"].get("type") == "object":
            assert "x-kubernetes-list-type" in node, path


def rules_with_paths(
    definition: dict[str, Any],
) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    for path, node in walk(schema_of(definition), ""):
        for rule in node.get("x-kubernetes-validations", []):
            yield path, node, rule


@pytest.mark.parametrize("definition", OURS, ids=[d["metadata"]["name"] for d in OURS])
def test_cel_rules_name_the_field_and_point_at_real_fields(definition: dict[str, Any]) -> None:
    rules = list(rules_with_paths(definition))
    assert rules
    for path, node, rule in rules:
        message = rule["message"]
        # A message names its field: by full path, or (in a block used at several places, such
        # as spec.pod and spec.frontend.pod, where the API server prefixes the path) relative
        # to the node the rule sits on.
        lead = re.match(r"[A-Za-z.\[\]]*", message).group(0)  # type: ignore[union-attr]
        first = lead.split(".")[0]
        assert (
            lead.startswith(("spec", "metadata.name"))
            or path.endswith(("." + lead, "." + first))
            or first in node.get("properties", {})
        ), (path, message)
        if "fieldPath" in rule:
            target = node
            for part in rule["fieldPath"].lstrip(".").split("."):
                target = target["properties"][part]
        # Literals stay single-quoted without escapes (cel_string refuses anything else).
        assert "\\" not in rule["rule"], (path, rule)


def test_immutable_fields_use_transition_rules() -> None:
    lora = schema_of(crd.custom_resource_definition(crd.LoRAAdapter))["properties"]["spec"]
    transition = [r for r in lora["x-kubernetes-validations"] if "oldSelf" in r["rule"]]
    assert {r["fieldPath"] for r in transition} == {".workerRef", ".adapterName"}


def test_printer_columns_and_subresources() -> None:
    dw, lora = (d["spec"]["versions"][0] for d in OURS)
    assert [c["name"] for c in dw["additionalPrinterColumns"] if "priority" not in c] == [
        "Ready",
        "Replicas",
        "Model",
        "Age",
    ]
    assert dw["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    assert [c["name"] for c in lora["additionalPrinterColumns"] if "priority" not in c] == [
        "Worker",
        "Loaded",
        "Ready",
        "Age",
    ]
    assert lora["subresources"] == {"status": {}}
    names = [d["spec"]["names"] for d in OURS]
    assert [(n["kind"], n["shortNames"]) for n in names] == [
        ("DynamoWorker", ["dw"]),
        ("LoRAAdapter", ["lora"]),
    ]
    assert all(
        d["spec"]["group"] == "dynamo.dev" and d["spec"]["scope"] == "Namespaced" for d in OURS
    )


def test_nested_defaults_reach_the_api_server() -> None:
    spec = schema_of(OURS[0])["properties"]["spec"]["properties"]
    # A default on the parent makes the API server fill in the sub-object when it is absent.
    assert spec["drain"]["default"] == {"gracePeriodSeconds": 5, "drainTimeoutSeconds": 30}
    assert spec["drain"]["properties"]["gracePeriodSeconds"]["default"] == 5
    assert spec["drain"]["properties"]["drainTimeoutSeconds"]["default"] == 30
    assert spec["resources"]["properties"]["gpusPerPod"]["default"] == 1
    assert spec["replicas"]["default"] == 1
    assert spec["metrics"]["properties"]["podMonitor"]["default"] == "Auto"
    assert "default" not in spec["lora"]["properties"]["maxLoras"]  # 4 only when enabled


def test_dynamo_worker_metadata_crd_is_upstreams() -> None:
    definition = crd.dynamo_worker_metadata_crd()
    assert definition["metadata"]["name"] == "dynamoworkermetadatas.nvidia.com"
    assert (
        "install only when absent"
        in definition["metadata"]["annotations"]["dynamo.dev/upstream-kind"]
    )
    names = definition["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == (
        "DynamoWorkerMetadata",
        "dynamoworkermetadatas",
        ["dwm"],
    )
    version = definition["spec"]["versions"][0]
    assert (version["name"], definition["spec"]["group"]) == ("v1alpha1", "nvidia.com")
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["data"]
    assert spec["properties"]["data"] == {
        "type": "object",
        "description": "Raw JSON blob containing DiscoveryMetadata",
        "x-kubernetes-preserve-unknown-fields": True,
    }
    assert "subresources" not in version  # upstream's kind has none


def test_cli_prints_every_crd_as_multi_document_yaml() -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["crds"]) == 0
    documents = [d for d in yaml.safe_load_all(out.getvalue()) if d is not None]
    assert documents == crd.all_crds()


def test_models_that_cannot_be_structural_are_refused() -> None:
    class Union(BaseModel):
        value: int | str = Field(description="either")

    class Exclusive(BaseModel):
        value: int = Field(gt=0, le=3, description="exclusive bound")

    class Url(BaseModel):
        value: str = Field(json_schema_extra={"format": "uri"}, description="url")

    for model in (Union, Exclusive, Url):
        with pytest.raises(NotStructuralError):
            structural_schema(model)


def test_optional_fields_become_not_required_without_null() -> None:
    class Inner(BaseModel):
        """Inner doc."""

        n: int = Field(ge=0, le=1, description="n")

    class Outer(BaseModel):
        inner: Inner | None = Field(default=None, description="Field doc wins.")
        required_inner: Inner = Field(description="Required.")

    schema = structural_schema(Outer)
    assert schema["required"] == ["required_inner"]
    inner = schema["properties"]["inner"]
    assert inner["description"] == "Field doc wins."
    assert inner["properties"]["n"] == {
        "type": "integer",
        "minimum": 0,
        "maximum": 1,
        "description": "n",
    }
    assert "null" not in str(schema)
