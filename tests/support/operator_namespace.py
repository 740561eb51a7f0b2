"""A namespace of its own with an operator watching it, for the end-to-end tests whose worker
pods run on the process node.

`operator_namespace` installs the CRDs, creates the namespace, makes a folder the pods can
read (a pod's /tmp is its own, so models and adapters must live elsewhere on the host), and
starts `dynamo-operator run` for the namespace, with the chart's worker-admin RBAC and a token for
the workers' audience (`support.worker_admin`). On exit it stops the operator, strips the
finalizers it would have removed (nothing may outlive it stuck in Terminating), and deletes
the namespace and the folder.
"""

from __future__ import annotations

import contextlib
import shutil
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamo_operator.k8s.client import Cluster as OperatorCluster
from dynamo_operator.reconcile.crds import install_crds
from support.cluster import Cluster, eventually
from support.operator_process import OperatorProcess, start_operator
from support.upstream import SAMPLE_ENGINE
from support.worker_admin import chart_worker_admin

T = TypeVar("T")
# The engine that serves the tiny model with real LoRA math (peft), for the e2e tests.
TRANSFORMERS_ENGINE = "dynamo.engines.transformers_engine:TransformersEngine"
GROUP, VERSION = "dynamo.dev", "v1alpha1"
MERGE: dict[str, Any] = {"_content_type": "application/merge-patch+json"}
# Worker pods go to the process node (tainted so that nothing else lands there).
ON_PROCESS_NODE: dict[str, Any] = {
    "nodeSelector": {"dynamo.dev/node-kind": "process"},
    "tolerations": [
        {"key": "dynamo.dev/process-node", "operator": "Exists", "effect": "NoSchedule"}
    ],
}


def serving_worker_spec(
    base_model: Path | str,
    replicas: int = 2,
    *,
    engine: str = SAMPLE_ENGINE,
    max_loras: int | None = None,
    s3: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A DynamoWorker spec whose pods serve the tiny model at `base_model` with `engine` on
    the process node, LoRA enabled (`max_loras` slots, else the default), no drain wait on
    deletion, and `s3` as spec.credentials.s3 when given (secretName, endpoint, region)."""
    lora: dict[str, Any] = {"enabled": True}
    if max_loras is not None:
        lora["maxLoras"] = max_loras
    spec: dict[str, Any] = {
        "model": {"name": "tiny-llama", "source": str(base_model)},
        "replicas": replicas,
        "engine": {"class": engine},
        "resources": {"gpusPerPod": 0},
        "lora": lora,
        "drain": {"gracePeriodSeconds": 0, "drainTimeoutSeconds": 1},
        "pod": ON_PROCESS_NODE,
    }
    if s3 is not None:
        spec["credentials"] = {"s3": dict(s3)}
    return spec


@dataclass
class OperatorNamespace:
    """The namespace, the folder its pods can read, and the operator watching it."""

    api: client.ApiClient
    namespace: str
    shared: Path
    operator: OperatorProcess

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    async def eventually(
        self,
        what: str,
        probe: Callable[[], Awaitable[T]],
        within: float,
        until: Callable[[T], bool],
    ) -> T:
        """Wait for `until(probe())`, failing with `what` and the operator's log tail."""
        return await self.operator.eventually(what, probe, within, until)

    async def create(self, plural: str, body: dict[str, Any]) -> None:
        """Create one of our custom objects (`dynamoworkers`, `loraadapters`) here."""
        await self.custom.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, plural, body
        )


@asynccontextmanager
async def operator_namespace(
    api: client.ApiClient, testbed: Cluster, prefix: str, log_dir: Path
) -> AsyncIterator[OperatorNamespace]:
    """See the module docstring; `prefix` starts the namespace's name."""
    await install_crds(OperatorCluster(api))
    core = client.CoreV1Api(api)
    namespace = f"{prefix}-{uuid.uuid4().hex[:8]}"
    body: Any = {"metadata": {"name": namespace, "labels": {"dynamo.dev/test": "true"}}}
    await core.create_namespace(body)
    await eventually(lambda: core.read_namespaced_service_account("default", namespace), 30)
    shared = Path(testbed.kubeconfig).parent / "e2e" / namespace
    shared.mkdir(parents=True)
    async with chart_worker_admin(api, namespace, log_dir) as token:
        operator = start_operator(
            testbed,
            [namespace],
            log_dir / "operator.log",
            resync_seconds=3.0,
            extra_args=("--worker-token-file", str(token)),
        )
        found = OperatorNamespace(api, namespace, shared, operator)
        try:
            await operator.wait_serving()
            yield found
        finally:
            operator.stop()
            for plural in ("loraadapters", "dynamoworkers"):
                with contextlib.suppress(ApiException):
                    listing = await found.custom.list_namespaced_custom_object(
                        GROUP, VERSION, namespace, plural
                    )
                    for item in listing["items"]:
                        await found.custom.patch_namespaced_custom_object(
                            GROUP, VERSION, namespace, plural, item["metadata"]["name"],
                            {"metadata": {"finalizers": None}}, **MERGE,
                        )  # fmt: skip
            await core.delete_namespace(namespace)
            shutil.rmtree(shared, ignore_errors=True)
