"""The generated CRDs on a real API server: they install, the server fills in the same defaults
as the models, refuses every bad manifest of the shared table with a message naming the field,
enforces immutability, and serves the scale subresource and printer columns."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamo_operator.api import DynamoWorker, DynamoWorkerMetadata, LoRAAdapter
from dynamo_operator.api.crd import custom_resource_definition, dynamo_worker_metadata_crd
from dynamo_operator.api.resource import Resource
from support.api_cases import INVALID, VALID, Invalid, dynamo_worker, lora_adapter
from support.cluster import Cluster, eventually

pytestmark = pytest.mark.cluster

GROUP, VERSION = "dynamo.dev", "v1alpha1"
KINDS: dict[str, tuple[type[Resource], str]] = {
    "DynamoWorker": (DynamoWorker, "dynamoworkers"),
    "LoRAAdapter": (LoRAAdapter, "loraadapters"),
}
# The client guesses a patch's content type; say it (the stubs do not know this keyword).
MERGE_PATCH: dict[str, Any] = {"_content_type": "application/merge-patch+json"}


# The client takes plain dicts as bodies; its stubs name only its model classes, hence `Any`.
async def _create_or_replace(ext: client.ApiextensionsV1Api, body: Any) -> None:
    name = body["metadata"]["name"]
    try:
        current = await ext.read_custom_resource_definition(name)
    except ApiException as exc:
        if exc.status != 404:
            raise
        await ext.create_custom_resource_definition(body)
        return
    replacement: Any = {
        **body,
        "metadata": {**body["metadata"], "resourceVersion": current.metadata.resource_version},
    }
    await ext.replace_custom_resource_definition(name, replacement)


async def _create_if_absent(ext: client.ApiextensionsV1Api, body: Any) -> None:
    try:
        await ext.create_custom_resource_definition(body)
    except ApiException as exc:
        if exc.status != 409:  # already there: upstream's own, or ours from an earlier run
            raise


async def _established(ext: client.ApiextensionsV1Api, name: str) -> bool:
    crd = await ext.read_custom_resource_definition(name)
    return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])


@pytest_asyncio.fixture(scope="session")
async def installed_crds(api: client.ApiClient) -> AsyncIterator[None]:
    """Our CRDs created or replaced (the upstream one only created when absent), Established."""
    ext = client.ApiextensionsV1Api(api)
    ours = [custom_resource_definition(DynamoWorker), custom_resource_definition(LoRAAdapter)]
    upstream = dynamo_worker_metadata_crd()

    async def install() -> None:
        # Another test may replace the same CRD at the same moment (409): try again.
        for body in ours:
            await _create_or_replace(ext, body)
        await _create_if_absent(ext, upstream)

    async def all_established() -> bool:
        names = [body["metadata"]["name"] for body in [*ours, upstream]]
        return all([await _established(ext, name) for name in names])

    await eventually(install, 30)
    await eventually(all_established, 60, bool)
    yield


def _plural(manifest: dict[str, Any]) -> str:
    return KINDS[manifest["kind"]][1]


async def _create(
    api: client.ApiClient, namespace: str, manifest: dict[str, Any], dry_run: bool = False
) -> Any:
    custom = client.CustomObjectsApi(api)
    extra: dict[str, Any] = {"field_validation": "Strict"}  # as kubectl apply does by default
    if dry_run:
        extra["dry_run"] = "All"
    return await custom.create_namespaced_custom_object(
        GROUP, VERSION, namespace, _plural(manifest), manifest, **extra
    )


def _without_empty(value: Any) -> Any:
    """Drop empty lists and maps: the models default them to empty, the server leaves them out."""
    if isinstance(value, dict):
        pruned = {k: _without_empty(v) for k, v in value.items()}
        return {k: v for k, v in pruned.items() if v not in ({}, [])}
    if isinstance(value, list):
        return [_without_empty(v) for v in value]
    return value


@pytest.mark.parametrize(("case_id", "manifest"), VALID, ids=[c for c, _ in VALID])
async def test_valid_manifests_are_accepted_with_the_models_defaults(
    api: client.ApiClient,
    namespace: str,
    installed_crds: None,
    case_id: str,
    manifest: dict[str, Any],
) -> None:
    # The server serves the kind a moment after Established; the first create proves it.
    stored = await eventually(lambda: _create(api, namespace, manifest, dry_run=True), 30)
    model = KINDS[manifest["kind"]][0]
    parsed = model.model_validate(manifest)
    # What the API server stored (its defaults applied) is what the models default to.
    assert _without_empty(stored["spec"]) == _without_empty(parsed.to_dict()["spec"])


@pytest.mark.parametrize("case", INVALID, ids=[c.id for c in INVALID])
async def test_invalid_manifests_are_refused_naming_the_field(
    api: client.ApiClient, namespace: str, installed_crds: None, case: Invalid
) -> None:
    async def refusal() -> ApiException:
        try:
            await _create(api, namespace, case.manifest, dry_run=True)
        except ApiException as exc:
            if exc.status == 404:  # the kind is not served yet
                raise
            return exc
        raise AssertionError(f"{case.id}: the API server accepted {case.manifest}")

    refused = await eventually(refusal, 30)
    assert refused.status in (400, 422), refused
    message = json.loads(refused.body or b"{}")["message"]
    assert case.field in message, message
    if case.message is not None:
        assert case.message in message, message


async def _replace_spec(
    api: client.ApiClient, namespace: str, plural: str, name: str, spec: dict[str, Any]
) -> Any:
    custom = client.CustomObjectsApi(api)
    current = await custom.get_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)
    current["spec"] = spec
    return await custom.replace_namespaced_custom_object(
        GROUP, VERSION, namespace, plural, name, current
    )


async def test_lora_target_and_name_are_immutable(
    api: client.ApiClient, namespace: str, installed_crds: None
) -> None:
    manifest = lora_adapter("sql", {"adapterName": "sql-expert"})
    created = await eventually(lambda: _create(api, namespace, manifest), 30)
    spec = created["spec"]

    refusals = {
        "spec.workerRef is immutable": {**spec, "workerRef": {"name": "other"}},
        "spec.adapterName is immutable": {**spec, "adapterName": "renamed"},
    }
    selector_instead = {k: v for k, v in spec.items() if k != "workerRef"}
    selector_instead["workerSelector"] = {"matchLabels": {"team": "a"}}
    refusals_list = [*refusals.items(), ("spec.workerRef is immutable", selector_instead)]
    for expected, new_spec in refusals_list:
        with pytest.raises(ApiException) as refused:
            await _replace_spec(api, namespace, "loraadapters", "sql", new_spec)
        assert refused.value.status == 422
        assert expected in json.loads(refused.value.body or b"{}")["message"]

    # The source may change: that is how a new adapter version rolls out.
    rolled = await _replace_spec(
        api, namespace, "loraadapters", "sql", {**spec, "source": {"uri": "s3://adapters/sql/v2"}}
    )
    assert rolled["spec"]["source"]["uri"] == "s3://adapters/sql/v2"
    assert LoRAAdapter.model_validate(rolled).adapter_name == "sql-expert"


async def test_scale_subresource_and_printer_columns(
    api: client.ApiClient, cluster: Cluster, namespace: str, installed_crds: None
) -> None:
    custom = client.CustomObjectsApi(api)
    await eventually(lambda: _create(api, namespace, dynamo_worker("llm")), 30)

    # Status as the operator will write it: through the status subresource.
    current = await custom.get_namespaced_custom_object(
        GROUP, VERSION, namespace, "dynamoworkers", "llm"
    )
    current["status"] = {
        "replicas": 1,
        "readyReplicas": 1,
        "selector": "dynamo.dev/worker=llm",
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "AllPodsReady",
                "message": "1/1 pods ready",
                "lastTransitionTime": "2025-01-01T00:00:00Z",
            }
        ],
    }
    await custom.replace_namespaced_custom_object_status(
        GROUP, VERSION, namespace, "dynamoworkers", "llm", current
    )

    scale = await custom.get_namespaced_custom_object_scale(
        GROUP, VERSION, namespace, "dynamoworkers", "llm"
    )
    assert scale["spec"]["replicas"] == 1
    assert scale["status"] == {"replicas": 1, "selector": "dynamo.dev/worker=llm"}

    # What an HPA does: write spec.replicas through the scale subresource.
    await custom.patch_namespaced_custom_object_scale(
        GROUP,
        VERSION,
        namespace,
        "dynamoworkers",
        "llm",
        {"spec": {"replicas": 3}},
        **MERGE_PATCH,
    )
    stored = await custom.get_namespaced_custom_object(
        GROUP, VERSION, namespace, "dynamoworkers", "llm"
    )
    assert DynamoWorker.model_validate(stored).spec.replicas == 3

    # The scale subresource goes through the same validation as the spec.
    with pytest.raises(ApiException) as refused:
        await custom.patch_namespaced_custom_object_scale(
            GROUP,
            VERSION,
            namespace,
            "dynamoworkers",
            "llm",
            {"spec": {"replicas": 5000}},
            **MERGE_PATCH,
        )
    assert refused.value.status == 422
    assert "spec.replicas" in json.loads(refused.value.body or b"{}")["message"]

    # `kubectl scale dw` and `kubectl get dw`, as users run them.
    cluster.kubectl("scale", "dw/llm", "--replicas=2", "-n", namespace)
    stored = await custom.get_namespaced_custom_object(
        GROUP, VERSION, namespace, "dynamoworkers", "llm"
    )
    assert stored["spec"]["replicas"] == 2
    table = cluster.kubectl("get", "dw", "-n", namespace).stdout.splitlines()
    assert table[0].split() == ["NAME", "READY", "REPLICAS", "MODEL", "AGE"]
    assert table[1].split()[:4] == ["llm", "True", "1", "Qwen/Qwen3-0.6B"]


async def test_lora_printer_columns(
    api: client.ApiClient, cluster: Cluster, namespace: str, installed_crds: None
) -> None:
    custom = client.CustomObjectsApi(api)
    await eventually(lambda: _create(api, namespace, lora_adapter("sql")), 30)
    current = await custom.get_namespaced_custom_object(
        GROUP, VERSION, namespace, "loraadapters", "sql"
    )
    current["status"] = {
        "loadedReplicas": 3,
        "targetReplicas": 4,
        "loaded": "3/4",
        "pods": [{"pod": "llm-0", "state": "Loaded", "loraId": 7}],
        "conditions": [
            {
                "type": "Ready",
                "status": "False",
                "reason": "PodsLoading",
                "lastTransitionTime": "2025-01-01T00:00:00Z",
            }
        ],
    }
    await custom.replace_namespaced_custom_object_status(
        GROUP, VERSION, namespace, "loraadapters", "sql", current
    )
    table = cluster.kubectl("get", "lora", "-n", namespace).stdout.splitlines()
    assert table[0].split() == ["NAME", "WORKER", "LOADED", "READY", "AGE"]
    assert table[1].split()[:4] == ["sql", "llm", "3/4", "False"]
    # `kubectl get dynamo` lists both kinds (the shared category).
    listed = cluster.kubectl("get", "dynamo", "-n", namespace, "-o", "name").stdout
    assert "loraadapter.dynamo.dev/sql" in listed


async def test_dynamo_worker_metadata_records_are_stored_and_readable(
    api: client.ApiClient, namespace: str, installed_crds: None
) -> None:
    card = {
        "type": "Model",
        "namespace": "dynamo",
        "component": "worker",
        "endpoint": "generate",
        "instance_id": 1186445869714687,
        "card_json": {
            "display_name": "Qwen/Qwen3-0.6B",
            "slug": "qwen_qwen3-0_6b",
            "runtime_config": {
                "taints": ["gpu=h100"],
                "data_parallel_size": 1,
                "runtime_data": {"token_budget": {"combined_limit": 2048}},
            },
        },
    }
    body = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoWorkerMetadata",
        "metadata": {"name": "worker-0"},
        "spec": {"data": {"endpoints": {}, "model_cards": {"dynamo/worker/generate/1": card}}},
    }
    custom = client.CustomObjectsApi(api)
    await eventually(
        lambda: custom.create_namespaced_custom_object(
            "nvidia.com", "v1alpha1", namespace, "dynamoworkermetadatas", body
        ),
        30,
    )
    stored = await custom.get_namespaced_custom_object(
        "nvidia.com", "v1alpha1", namespace, "dynamoworkermetadatas", "worker-0"
    )
    dwm = DynamoWorkerMetadata.model_validate(stored)
    budget = dwm.token_budget
    assert budget is not None
    assert budget.combined_limit == 2048
    assert dwm.taints == ["gpu=h100"]
    assert dwm.served_model_names == ["Qwen/Qwen3-0.6B"]
