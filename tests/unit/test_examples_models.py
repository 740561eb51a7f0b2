"""The manifests under examples/ are valid for the operator's own models (the API server's
view is tests/cluster/test_examples.py) and the Secrets hold placeholders only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from dynamo_operator.api import DynamoWorker, LoRAAdapter

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MODELS = {"DynamoWorker": DynamoWorker, "LoRAAdapter": LoRAAdapter}


def manifests() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


def test_examples_cover_what_users_need() -> None:
    kinds = [(name, doc["kind"]) for name, doc in manifests()]
    workers = [name for name, kind in kinds if kind == "DynamoWorker"]
    assert len(workers) >= 2, "a minimal and a full DynamoWorker"
    sources = [
        doc["spec"]["source"]["uri"].split("://")[0]
        for _, doc in manifests()
        if doc["kind"] == "LoRAAdapter"
    ]
    assert sorted(sources) == ["file", "hf", "s3"]
    assert any(kind == "Secret" for _, kind in kinds)


@pytest.mark.parametrize(
    ("name", "doc"), manifests(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_example_is_valid(name: str, doc: dict[str, Any]) -> None:
    assert "namespace" not in doc["metadata"], f"{name}: apply with -n, not a fixed namespace"
    if doc["kind"] in MODELS:
        MODELS[doc["kind"]].model_validate(doc)
    elif doc["kind"] == "Secret":
        for key, value in doc["stringData"].items():
            assert value.startswith("REPLACE-ME"), f"{name}: {key} must be a placeholder"
    else:
        raise AssertionError(f"{name}: unexpected kind {doc['kind']}")


def test_adapters_target_the_example_workers() -> None:
    docs = manifests()
    workers = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "DynamoWorker"}
    for name, doc in docs:
        if doc["kind"] != "LoRAAdapter":
            continue
        spec = doc["spec"]
        if "workerRef" in spec:
            target = workers[spec["workerRef"]["name"]]
        else:
            wanted = spec["workerSelector"]["matchLabels"].items()
            matches = [
                w for w in workers.values() if wanted <= w["metadata"].get("labels", {}).items()
            ]
            assert matches, f"{name}: no example worker matches its selector"
            target = matches[0]
        assert target["spec"]["lora"]["enabled"], f"{name}: its worker does not serve LoRA"
    secrets = {d["metadata"]["name"] for _, d in docs if d["kind"] == "Secret"}
    for worker in workers.values():
        credentials = worker["spec"].get("credentials") or {}
        for ref in credentials.values():
            assert ref["secretName"] in secrets
