"""CRD manifests generated from the models: structural OpenAPI v3 schemas, deterministic YAML.

Pydantic writes JSON Schema; the API server wants a structural schema. The conversion inlines
`$ref`s, drops titles, turns `Optional` (`anyOf` with null) into a plain not-required field,
turns `const` into a one-value `enum`, drops boolean `additionalProperties` (properties and
additionalProperties exclude each other in a CRD, and pruning already drops unknown fields),
bounds string enums by their longest value, and refuses JSON Schema keywords a CRD does not
take, so a model that cannot become a valid CRD fails here rather than at install time.

Run `hack/gen-crds` (or `python -m dynamo_operator.api.crd crds/ --chart helm/dynamo-operator
--reference docs/crd-reference.md`) after changing a model; a unit test fails while the files
under `crds/`, the chart's `templates/crds/` or the CRD reference (`api.reference`) are stale.

The chart carries the same CRDs as regular templates (not in Helm's `crds/` folder, which Helm
installs once and never upgrades): each is wrapped in `crds.install`, carries Helm's
`resource-policy: keep` when `crds.keep` is set, and upstream's DynamoWorkerMetadata is rendered
only when no copy exists that this release does not own (Helm's `lookup`).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from dynamo_operator.api import metadata as dwm
from dynamo_operator.api.dynamoworker import DynamoWorker
from dynamo_operator.api.loraadapter import LoRAAdapter
from dynamo_operator.api.resource import Resource

RESOURCES: tuple[type[Resource], ...] = (DynamoWorker, LoRAAdapter)
GENERATED_HEADER = (
    "# Generated from operator/src/dynamo_operator/api by hack/gen-crds; do not edit.\n"
)
UPSTREAM_HEADER = (
    "# Upstream Dynamo's DynamoWorkerMetadata CRD (ai-dynamo/dynamo,\n"
    "# deploy/operator/config/crd/bases/nvidia.com_dynamoworkermetadatas.yaml), reproduced as\n"
    "# upstream defines it: the workers write these records and upstream components read them.\n"
    "# Install it only when absent: a cluster that also runs upstream's platform keeps its own.\n"
)
PART_OF_LABEL = {"app.kubernetes.io/part-of": "dynamo-operator"}
ALLOWED_FORMATS = frozenset({"date-time"})
# JSON Schema keywords a structural CRD schema does not take (or that our models must not
# produce: exclusive bounds are booleans in OpenAPI v3.0, uniqueItems is refused by the API
# server, and oneOf/allOf/not would need the same fields spelled outside them).
REFUSED_KEYWORDS = frozenset(
    {
        "oneOf",
        "allOf",
        "not",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "uniqueItems",
        "prefixItems",
        "discriminator",
        "$defs",
        "patternProperties",
        "propertyNames",
    }
)


class NotStructuralError(ValueError):
    """A model produced JSON Schema that cannot become a structural CRD schema."""


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON schema (camelCase, validation mode) as a structural CRD schema."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    definitions = raw.pop("$defs", {})
    return _convert(raw, definitions, model.__name__)


def _convert(node: Mapping[str, Any], definitions: Mapping[str, Any], where: str) -> dict[str, Any]:
    node = dict(node)
    if "$ref" in node:
        name = node.pop("$ref").rsplit("/", 1)[-1]
        # The field's own keys (description, default, extensions) win over the type's.
        return {
            **_convert(definitions[name], definitions, name),
            **_convert(node, definitions, where),
        }
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        branches = [b for b in node.pop("anyOf") if b != {"type": "null"}]
        if len(branches) != 1:
            raise NotStructuralError(f"{where}: a union of several types cannot be a CRD field")
        if node.get("default", 0) is None:
            del node["default"]
        return {**_convert(branches[0], definitions, where), **_convert(node, definitions, where)}

    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in REFUSED_KEYWORDS:
            raise NotStructuralError(f"{where}: JSON Schema keyword {key!r} has no place in a CRD")
        if key == "title" or (key == "default" and value is None):
            continue
        if key == "additionalProperties":
            if not isinstance(value, bool):
                out[key] = _convert(value, definitions, f"{where}.*")
        elif key == "properties":
            out[key] = {
                name: _convert(sub, definitions, f"{where}.{name}") for name, sub in value.items()
            }
        elif key == "items":
            out[key] = _convert(value, definitions, f"{where}[]")
        elif key == "const":
            out["enum"] = [value]
        elif key == "format" and value not in ALLOWED_FORMATS:
            raise NotStructuralError(f"{where}: format {value!r} is not one the API server checks")
        else:
            out[key] = value
    if out.get("type") == "string" and "enum" in out and "maxLength" not in out:
        # Bounded strings keep CEL cost estimates finite; an enum's bound is its longest value.
        out["maxLength"] = max(len(str(v)) for v in out["enum"])
    return out


def openapi_schema(resource: type[Resource]) -> dict[str, Any]:
    """The `openAPIV3Schema` of a kind: apiVersion, kind, metadata, spec and status."""
    info = resource.info
    schema: dict[str, Any] = {
        "type": "object",
        "description": info.description,
        "properties": {
            "apiVersion": {
                "type": "string",
                "description": "Versioned schema of this representation of an object.",
            },
            "kind": {"type": "string", "description": "REST resource this object represents."},
            "metadata": {"type": "object"},
            "spec": structural_schema(info.spec_model),
            "status": structural_schema(info.status_model),
        },
        "required": ["spec"],
    }
    root_rules = resource.__dict__.get("cel_rules", ())
    if root_rules:
        schema["x-kubernetes-validations"] = [rule.to_schema() for rule in root_rules]
    return schema


def custom_resource_definition(resource: type[Resource]) -> dict[str, Any]:
    """The CustomResourceDefinition of one of our kinds."""
    info = resource.info
    subresources: dict[str, Any] = {"status": {}}
    if info.scale is not None:
        subresources["scale"] = {
            "specReplicasPath": info.scale.spec_replicas_path,
            "statusReplicasPath": info.scale.status_replicas_path,
            "labelSelectorPath": info.scale.label_selector_path,
        }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": info.crd_name, "labels": dict(PART_OF_LABEL)},
        "spec": {
            "group": info.group,
            "names": {
                "kind": info.kind,
                "listKind": f"{info.kind}List",
                "plural": info.plural,
                "singular": info.singular,
                "shortNames": list(info.short_names),
                "categories": list(info.categories),
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": info.version,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema(resource)},
                    "subresources": subresources,
                    "additionalPrinterColumns": [c.to_schema() for c in info.printer_columns],
                }
            ],
        },
    }


def dynamo_worker_metadata_crd() -> dict[str, Any]:
    """Upstream's DynamoWorkerMetadata CRD, field for field, plus annotations saying whose it is."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{dwm.PLURAL}.{dwm.GROUP}",
            "annotations": {
                "helm.sh/resource-policy": "keep",
                "dynamo.dev/upstream-kind": "DynamoWorkerMetadata belongs to upstream Dynamo "
                "(ai-dynamo/dynamo deploy/operator); install only when absent",
            },
        },
        "spec": {
            "group": dwm.GROUP,
            "names": {
                "kind": dwm.KIND,
                "listKind": f"{dwm.KIND}List",
                "plural": dwm.PLURAL,
                "singular": dwm.SINGULAR,
                "shortNames": [dwm.SHORT_NAME],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": dwm.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "DynamoWorkerMetadata stores discovery metadata for a "
                            "Dynamo worker pod",
                            "properties": {
                                "apiVersion": {
                                    "type": "string",
                                    "description": "APIVersion defines the versioned schema of "
                                    "this representation",
                                },
                                "kind": {
                                    "type": "string",
                                    "description": "Kind is a string value representing the "
                                    "REST resource",
                                },
                                "metadata": {"type": "object"},
                                "spec": {
                                    "type": "object",
                                    "description": "Spec contains the worker metadata",
                                    "required": ["data"],
                                    "properties": {
                                        "data": {
                                            "type": "object",
                                            "description": "Raw JSON blob containing "
                                            "DiscoveryMetadata",
                                            "x-kubernetes-preserve-unknown-fields": True,
                                        }
                                    },
                                },
                            },
                        }
                    },
                    "additionalPrinterColumns": [
                        {
                            "name": "Age",
                            "type": "date",
                            "jsonPath": ".metadata.creationTimestamp",
                        }
                    ],
                }
            ],
        },
    }


def render(manifest: Mapping[str, Any], header: str = GENERATED_HEADER) -> str:
    """One manifest as YAML: keys sorted, lines never folded, so output is byte-stable."""
    return header + yaml.safe_dump(dict(manifest), sort_keys=True, width=1 << 16)


def all_crds() -> list[dict[str, Any]]:
    """Every CRD the operator needs, ours first."""
    return [*(custom_resource_definition(r) for r in RESOURCES), dynamo_worker_metadata_crd()]


def crd_files() -> dict[str, str]:
    """File name under `crds/` -> its content."""
    files = {
        f"{r.info.group}_{r.info.plural}.yaml": render(custom_resource_definition(r))
        for r in RESOURCES
    }
    files[f"{dwm.GROUP}_{dwm.PLURAL}.yaml"] = render(dynamo_worker_metadata_crd(), UPSTREAM_HEADER)
    return files


def multi_document_yaml() -> str:
    """All CRDs as one multi-document YAML stream (what `dynamo-operator crds` prints)."""
    return "".join(f"---\n{text}" for text in crd_files().values())


def write_crds(directory: Path) -> list[Path]:
    """Write every CRD file into `directory`; returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in crd_files().items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written


def stale_files(directory: Path) -> list[str]:
    """Names of CRD files under `directory` that are missing or differ from the models."""
    return [
        name
        for name, text in crd_files().items()
        if not (directory / name).is_file() or (directory / name).read_text() != text
    ]


CHART_CRD_DIR = Path("templates") / "crds"
CHART_HEADER = (
    "{{- /* Generated from operator/src/dynamo_operator/api by hack/gen-crds; do not edit. */}}\n"
)
CHART_UPSTREAM_HEADER = (
    "{{- /*\n"
    + UPSTREAM_HEADER.replace("# ", "").replace("#\n", "\n")
    + "Rendered only when no copy exists that this release does not own. `helm template` cannot\n"
    "look the cluster up, so it always prints this CRD.\n"
    "Generated by hack/gen-crds; do not edit. */}}\n"
)


def _yaml_block(value: Mapping[str, Any], indent: int) -> str:
    text = yaml.safe_dump(dict(value), sort_keys=True, width=1 << 16)
    # `{{` would start a template action: print it through one instead.
    return textwrap.indent(text.replace("{{", '{{ "{{" }}'), " " * indent)


def chart_template(manifest: Mapping[str, Any], *, upstream: bool = False) -> str:
    """One CRD as a chart template (see the module docstring for what the template adds)."""
    meta = manifest["metadata"]
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    head = [
        CHART_UPSTREAM_HEADER if upstream else CHART_HEADER,
        "{{- if .Values.crds.install }}\n",
    ]
    if upstream:
        head.append(
            f'{{{{- $live := lookup "apiextensions.k8s.io/v1" "CustomResourceDefinition" "" '
            f'"{meta["name"]}" }}}}\n'
            '{{- if or (not $live) (include "dynamo-operator.ownedByRelease" (list $live .)) }}\n'
        )
    body = [
        _yaml_block({"apiVersion": manifest["apiVersion"], "kind": manifest["kind"]}, 0),
        "metadata:\n",
        f"  name: {meta['name']}\n",
        "  labels:\n",
        _yaml_block(labels, 4) if labels else "",
        '    {{- include "dynamo-operator.labels" . | nindent 4 }}\n',
    ]
    if upstream:
        # Upstream's kind: always kept, since removing a CRD removes every record of it.
        body += ["  annotations:\n", _yaml_block(annotations, 4)]
    else:
        body += [
            "  {{- if .Values.crds.keep }}\n",
            "  annotations:\n",
            "    helm.sh/resource-policy: keep\n",
            "  {{- end }}\n",
        ]
    body += [_yaml_block({"spec": manifest["spec"]}, 0)]
    tail = "{{- end }}\n{{- end }}\n" if upstream else "{{- end }}\n"
    return "".join([*head, *body, tail])


def chart_crd_files() -> dict[str, str]:
    """File name under the chart's `templates/crds/` -> its content."""
    files = {
        f"{r.info.group}_{r.info.plural}.yaml": chart_template(custom_resource_definition(r))
        for r in RESOURCES
    }
    files[f"{dwm.GROUP}_{dwm.PLURAL}.yaml"] = chart_template(
        dynamo_worker_metadata_crd(), upstream=True
    )
    return files


def write_chart_crds(chart: Path) -> list[Path]:
    """Write every CRD template into the chart at `chart`; returns the paths written."""
    directory = chart / CHART_CRD_DIR
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in chart_crd_files().items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written


def stale_chart_files(chart: Path) -> list[str]:
    """Names of CRD templates in the chart at `chart` that are missing or out of date."""
    directory = chart / CHART_CRD_DIR
    return [
        name
        for name, text in chart_crd_files().items()
        if not (directory / name).is_file() or (directory / name).read_text() != text
    ]


def main(argv: list[str] | None = None) -> int:
    """`python -m dynamo_operator.api.crd [--check] DIRECTORY [--chart CHART] [--reference MD]`."""
    parser = argparse.ArgumentParser(description="Write the CRDs generated from the API models.")
    parser.add_argument("directory", type=Path, help="where the CRD files go, e.g. crds/")
    parser.add_argument(
        "--chart",
        type=Path,
        help="also write them as templates into this chart, e.g. helm/dynamo-operator",
    )
    parser.add_argument(
        "--reference",
        type=Path,
        help="also write the Markdown CRD reference to this file, e.g. docs/crd-reference.md",
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if any file is stale"
    )
    args = parser.parse_args(argv)
    # Imported here: the reference module builds on this one.
    from dynamo_operator.api import reference

    if args.check:
        stale = [args.directory / name for name in stale_files(args.directory)]
        if args.chart is not None:
            stale += [args.chart / CHART_CRD_DIR / n for n in stale_chart_files(args.chart)]
        if args.reference is not None and reference.reference_is_stale(args.reference):
            stale.append(args.reference)
        for path in stale:
            print(f"{path} is stale: run hack/gen-crds", file=sys.stderr)
        return 1 if stale else 0
    written = write_crds(args.directory)
    if args.chart is not None:
        written += write_chart_crds(args.chart)
    if args.reference is not None:
        written.append(reference.write_reference(args.reference))
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
