"""The Kubernetes discovery backend against the test bed's API server: a real Pod (on a KWOK
node), the backend configured only from the env a worker pod gets, and upstream's object
checked as the API server stores it: owner, field manager, layout, updates, garbage collection.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamo.runtime.discovery import (
    AdapterCard,
    EndpointAddress,
    WorkerAdvertisement,
    backend_from_env,
    instance_id_from_env,
)
from dynamo.runtime.discovery.kubernetes import KubernetesBackend
from dynamo.runtime.discovery.records import metadata_for
from support.cluster import Cluster, ensure_crd, eventually

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "nvidia.com_dynamoworkermetadatas.yaml"
GROUP, VERSION, PLURAL = "nvidia.com", "v1alpha1", "dynamoworkermetadatas"
POD_NAME = "worker-0"  # upstream 1.6.1 was observed to key this pod's endpoint as below
ENDPOINT_KEY = "dynamo/backend/generate/43710f49c0cff"


@pytest_asyncio.fixture
async def crd(api: client.ApiClient) -> None:
    """Upstream's CRD from the checked-in file, created when absent, Established."""
    await ensure_crd(api, CRD)


async def _pod(api: client.ApiClient, namespace: str) -> Any:
    body: Any = {
        "metadata": {"name": POD_NAME, "labels": {"app": "discovery-test"}},
        "spec": {
            "nodeSelector": {"type": "kwok"},
            "containers": [{"name": "main", "image": "example.invalid/worker:1"}],
        },
    }
    return await client.CoreV1Api(api).create_namespaced_pod(namespace, body)


async def _read(api: client.ApiClient, namespace: str) -> dict[str, Any]:
    objects = client.CustomObjectsApi(api)
    got: dict[str, Any] = await objects.get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, POD_NAME
    )
    return got


def _advertisement(instance_id: int, **changes: Any) -> WorkerAdvertisement:
    fields: dict[str, Any] = {
        "address": EndpointAddress("dynamo", "backend", "generate"),
        "instance_id": instance_id,
        "served_model_name": "tiny",
        "model": "/models/tiny",
        "transport": {"http": "http://10.0.0.7:8000"},
        "runtime_config": {"context_length": 512, "total_kv_blocks": 64, "max_num_seqs": 8},
    }
    fields.update(changes)
    return WorkerAdvertisement(**fields)


def _same_json(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@pytest.mark.usefixtures("crd")
async def test_worker_metadata_lifecycle(
    api: client.ApiClient, namespace: str, cluster: Cluster
) -> None:
    pod = await _pod(api, namespace)
    env = {
        "DYN_DISCOVERY_BACKEND": "kubernetes",
        "POD_NAME": POD_NAME,
        "POD_NAMESPACE": namespace,
        "POD_UID": pod.metadata.uid,
        "KUBECONFIG": str(cluster.kubeconfig),
    }
    backend = backend_from_env(env)
    assert isinstance(backend, KubernetesBackend)
    instance_id = instance_id_from_env(env)
    adv = _advertisement(instance_id)
    try:
        await backend.register(adv)

        # Upstream's object: name, owner, field manager, and spec.data in upstream's layout.
        stored = await _read(api, namespace)
        meta = stored["metadata"]
        assert stored["apiVersion"] == "nvidia.com/v1alpha1"
        assert stored["kind"] == "DynamoWorkerMetadata"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": POD_NAME,
                "uid": pod.metadata.uid,
                "controller": True,
                "blockOwnerDeletion": False,
            }
        ]
        assert [(m["manager"], m["operation"]) for m in meta["managedFields"]] == [
            ("dynamo-worker", "Apply")
        ]
        data = stored["spec"]["data"]
        assert _same_json(data, metadata_for(adv))
        assert set(data["endpoints"]) == {ENDPOINT_KEY}
        assert data["endpoints"][ENDPOINT_KEY]["instance_id"] == 1186445869714687
        assert data["model_cards"][ENDPOINT_KEY]["card_json"]["display_name"] == "tiny"
        assert _same_json(backend.metadata(), data)

        # An adapter loaded: its card appears next to the base card.
        with_adapter = _advertisement(
            instance_id, adapters=(AdapterCard("My-LoRA.v1", 42, "s3://loras/my"),)
        )
        await backend.update(with_adapter)
        data = (await _read(api, namespace))["spec"]["data"]
        lora_key = f"{ENDPOINT_KEY}/my-lora_v1"
        assert set(data["model_cards"]) == {ENDPOINT_KEY, lora_key}
        assert data["model_cards"][lora_key]["model_suffix"] == "my-lora_v1"
        assert data["model_cards"][lora_key]["card_json"]["lora"] == {"name": "My-LoRA.v1"}

        # Taints changed: the base card carries them, the adapter card is still there.
        tainted = _advertisement(
            instance_id,
            adapters=with_adapter.adapters,
            runtime_config={**with_adapter.runtime_config, "taints": ["team=a", "gpu=h100"]},
        )
        await backend.update(tainted)
        data = (await _read(api, namespace))["spec"]["data"]
        base_rc = data["model_cards"][ENDPOINT_KEY]["card_json"]["runtime_config"]
        assert base_rc["taints"] == ["gpu=h100", "team=a"]
        assert lora_key in data["model_cards"]

        # Adapter unloaded: its card goes (server-side apply drops the field we stop sending).
        await backend.update(_advertisement(instance_id, runtime_config=tainted.runtime_config))
        data = (await _read(api, namespace))["spec"]["data"]
        assert set(data["model_cards"]) == {ENDPOINT_KEY}

        # Unregister: no endpoint for readers; the cards stay until the pod goes.
        await backend.unregister()
        data = (await _read(api, namespace))["spec"]["data"]
        assert not data.get("endpoints")
        assert set(data["model_cards"]) == {ENDPOINT_KEY}
    finally:
        await backend.close()

    # The pod is the owner: deleting it garbage-collects the object.
    await client.CoreV1Api(api).delete_namespaced_pod(POD_NAME, namespace, grace_period_seconds=0)

    async def gone() -> bool:
        try:
            await _read(api, namespace)
        except ApiException as exc:
            return exc.status == 404
        return False

    await eventually(gone, 60, bool)


@pytest.mark.usefixtures("crd")
async def test_apply_errors_name_the_object_and_the_likely_cause(
    api: client.ApiClient, namespace: str, cluster: Cluster
) -> None:
    env = {
        "DYN_DISCOVERY_BACKEND": "kubernetes",
        "POD_NAME": POD_NAME,
        "POD_NAMESPACE": f"{namespace}-absent",
        "POD_UID": "00000000-0000-0000-0000-000000000000",
        "KUBECONFIG": str(cluster.kubeconfig),
    }
    backend = backend_from_env(env)
    try:
        with pytest.raises(
            RuntimeError,
            match=r"metadatas\.nvidia\.com 'worker-0' in namespace '.*-absent': the namespace",
        ):
            await backend.register(_advertisement(instance_id_from_env(env)))
    finally:
        await backend.close()
