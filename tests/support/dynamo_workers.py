"""DynamoWorkers on a real API server, for the tests that run the operator against it: create
one, wait until it is Ready, list its children and pods; the `crds` fixture.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest_asyncio
from kubernetes_asyncio import client

from dynamo_operator.k8s.client import Cluster as OperatorCluster
from dynamo_operator.reconcile.crds import install_crds
from support.api_cases import dynamo_worker
from support.cluster import eventually

GROUP, VERSION, PLURAL = "dynamo.dev", "v1alpha1", "dynamoworkers"


@pytest_asyncio.fixture(scope="session")
async def crds(api: client.ApiClient) -> AsyncIterator[None]:
    """The CRDs installed as the operator installs them (so its start writes none)."""
    await install_crds(OperatorCluster(api))
    yield


async def create_worker(
    api: client.ApiClient, namespace: str, name: str, spec: dict[str, Any] | None = None
) -> dict[str, Any]:
    body: Any = dynamo_worker(name, {"replicas": 2, **(spec or {})})
    result: dict[str, Any] = await client.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, body
    )
    return result


async def get_worker(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    result: dict[str, Any] = await client.CustomObjectsApi(api).get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name
    )
    return result


def condition(worker: dict[str, Any], type_: str) -> dict[str, Any]:
    for c in (worker.get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return dict(c)
    return {}


def status_is_current(worker: dict[str, Any]) -> bool:
    """Whether the status says what the operator made of the latest spec (as `kubectl wait`
    users wait: a spec change is seen once status.observedGeneration reaches it)."""
    return (worker.get("status") or {}).get("observedGeneration") == worker["metadata"][
        "generation"
    ]


def is_ready(worker: dict[str, Any], replicas: int) -> bool:
    status = worker.get("status") or {}
    return (
        condition(worker, "Ready").get("status") == "True"
        and status.get("readyReplicas") == replicas
        and status_is_current(worker)
        and condition(worker, "Progressing").get("reason") == "RolloutComplete"
    )


async def wait_ready(
    api: client.ApiClient, namespace: str, name: str, replicas: int, within: float = 60
) -> dict[str, Any]:
    return await eventually(
        lambda: get_worker(api, namespace, name), within, lambda w: is_ready(w, replicas)
    )


async def children(api: client.ApiClient, namespace: str, worker: str) -> dict[str, list[Any]]:
    """Every child kind's objects labelled for `worker`."""
    selector = f"dynamo.dev/worker={worker}"
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    rbac, policy = client.RbacAuthorizationV1Api(api), client.PolicyV1Api(api)
    listings: tuple[Any, ...] = await asyncio.gather(
        apps.list_namespaced_deployment(namespace, label_selector=selector),
        core.list_namespaced_service(namespace, label_selector=selector),
        core.list_namespaced_service_account(namespace, label_selector=selector),
        rbac.list_namespaced_role(namespace, label_selector=selector),
        rbac.list_namespaced_role_binding(namespace, label_selector=selector),
        policy.list_namespaced_pod_disruption_budget(namespace, label_selector=selector),
    )
    kinds = ("Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "PDB")
    return {kind: list(listing.items) for kind, listing in zip(kinds, listings, strict=True)}


def owned_by(obj: Any, uid: str) -> bool:
    refs = obj.metadata.owner_references or []
    return len(refs) == 1 and refs[0].uid == uid and refs[0].controller is True


async def pods(api: client.ApiClient, namespace: str, worker: str) -> list[Any]:
    listing = await client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"dynamo.dev/worker={worker}"
    )
    return [p for p in listing.items if p.metadata.deletion_timestamp is None]
