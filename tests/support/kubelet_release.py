"""The chart installed from the locally built images onto the test bed's kubelet node, for the
tests that run what users run (tests/e2e/test_chart_real_images.py, test_model_cache_on_node.py).

`operator_release` installs one release watching one fresh namespace (both namespaces under
the restricted Pod Security Standard) and uninstalls it after; `s3_credentials` puts an S3
server's keys into a Secret there; `state` is what a failure message needs.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio import client

from support.cluster import REPO, Cluster
from support.helm import CHART, require_helm, run_helm, set_args
from support.images import Images
from support.s3 import S3Server
from support.testbed_kubectl import kubectl

sys.path.insert(0, str(REPO / "hack"))
from testbed import kubelet_node

GROUP, VERSION = "dynamo.dev", "v1alpha1"
# Pods go to the kubelet node only, and tolerate its taint.
ON_THE_NODE: dict[str, Any] = {
    "nodeSelector": {"kubernetes.io/hostname": kubelet_node.NODE_NAME},
    "tolerations": [{"key": kubelet_node.TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
}
RESTRICTED = "pod-security.kubernetes.io/enforce=restricted"


def new_namespace(testbed: Cluster, *labels: str) -> str:
    name = f"img-{uuid.uuid4().hex[:8]}"
    testbed.kubectl("create", "namespace", name)
    testbed.kubectl("label", "namespace", name, "dynamo.dev/test=true", *labels)
    return name


def state(testbed: Cluster, *namespaces: str) -> str:
    """What a failure needs: every pod with its node and status, and the Events."""
    out = []
    for namespace in namespaces:
        for what in ("pods -o wide", "events --sort-by=.lastTimestamp"):
            got = kubectl(testbed, "-n", namespace, "get", *what.split())
            out.append(f"$ kubectl -n {namespace} get {what}\n{got.stdout}{got.stderr}")
    return "\n".join(out)


@dataclass(frozen=True)
class Release:
    """An installed release: the operator's namespace and the one it watches."""

    home: str
    watched: str


@asynccontextmanager
async def operator_release(
    testbed: Cluster, node_images: Images, *, replicas: int = 1
) -> AsyncIterator[Release]:
    """`helm install` of the operator image on the kubelet node, watching a new namespace
    (namespaced RBAC: the chart's own rules are all the operator has); uninstalled after."""
    helm = require_helm()
    release = f"img-{uuid.uuid4().hex[:4]}"
    home = new_namespace(testbed, RESTRICTED)
    watched = new_namespace(testbed, RESTRICTED)
    repository, tag = node_images["operator"].split(":")
    values = {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "replicaCount": replicas,
        "rbac": {"scope": "namespaced", "watchNamespaces": [watched]},
        "workerDefaults": {"image": node_images["worker"]},
        **ON_THE_NODE,
    }
    try:
        # --take-ownership: the CRDs exist already (other tests, earlier releases).
        installed = run_helm(
            helm, "install", release, str(CHART), "-n", home, *set_args(values),
            "--take-ownership", "--wait", "--timeout", "280s",
            kubeconfig=testbed.kubeconfig, check=False,
        )  # fmt: skip
        assert installed.returncode == 0, f"{installed.stderr}\n{state(testbed, home)}"
        yield Release(home, watched)
    finally:
        run_helm(helm, "uninstall", release, "-n", home, "--wait", "--timeout", "120s",
                 kubeconfig=testbed.kubeconfig, check=False)  # fmt: skip
        for namespace in (watched, home):
            testbed.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


async def s3_credentials(
    api: client.ApiClient, namespace: str, s3: S3Server, name: str = "s3-credentials"
) -> dict[str, str]:
    """A Secret holding `s3`'s keys; the DynamoWorker's spec.credentials.s3 that uses it."""
    secret: Any = {
        "metadata": {"name": name},
        "stringData": {
            "AWS_ACCESS_KEY_ID": s3.env["AWS_ACCESS_KEY_ID"],
            "AWS_SECRET_ACCESS_KEY": s3.env["AWS_SECRET_ACCESS_KEY"],
        },
    }
    await client.CoreV1Api(api).create_namespaced_secret(namespace, secret)
    return {"secretName": name, "endpoint": s3.endpoint_url, "region": "us-east-1"}


async def dynamo_worker(api: client.ApiClient, namespace: str, name: str, spec: Any) -> None:
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DynamoWorker",
            "metadata": {"name": name}, "spec": spec}  # fmt: skip
    await client.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, "dynamoworkers", body
    )


async def condition(api: client.ApiClient, namespace: str, name: str, type_: str) -> Any:
    """The DynamoWorker's condition of `type_` (a dict), or None."""
    worker = await client.CustomObjectsApi(api).get_namespaced_custom_object(
        GROUP, VERSION, namespace, "dynamoworkers", name
    )
    conditions = (worker.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), None)
