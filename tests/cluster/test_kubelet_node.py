"""The test bed's kubelet node (`kubelet-node-0`): the real kubelet, containerd and runc
enforce what a pod spec asks for, and the API server reaches the kubelet as on any cluster
(`kubectl logs` and `exec`). The pods run the operator's image, as built by
hack/build-images and imported into the node (nothing is pulled)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from support.cluster import REPO, Cluster, eventually
from support.images import Images
from support.testbed_kubectl import kubectl

pytestmark = pytest.mark.cluster

sys.path.insert(0, str(REPO / "hack"))
from testbed import kubelet_node  # noqa: E402
from testbed.layout import GPUS_PER_NODE  # noqa: E402

ON_THE_NODE = {
    "nodeSelector": {"kubernetes.io/hostname": kubelet_node.NODE_NAME},
    "tolerations": [{"key": kubelet_node.TAINT_KEY, "operator": "Exists"}],
}
# What the chart's pods get (helm/*/values.yaml's podSecurityContext and securityContext).
POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "fsGroup": 10001,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY = {
    "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}
SERVE = (
    "import http.server as h; h.HTTPServer(('', 8080), h.SimpleHTTPRequestHandler).serve_forever()"
)


def _pod(name: str, image: str, **container: Any) -> Any:
    return {
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            **ON_THE_NODE,
            "securityContext": POD_SECURITY,
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "securityContext": CONTAINER_SECURITY,
                    "workingDir": "/tmp",
                    "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                    **container,
                }
            ],
            "volumes": [{"name": "tmp", "emptyDir": {"medium": "Memory"}}],
        },
    }


async def _running(api: client.ApiClient, namespace: str, name: str) -> client.V1Pod:
    core = client.CoreV1Api(api)
    return await eventually(
        lambda: core.read_namespaced_pod(name, namespace),
        120,
        lambda p: any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or []),
    )


async def test_the_node_is_ready_with_its_gpus_and_taint(api: client.ApiClient) -> None:
    node = await client.CoreV1Api(api).read_node(kubelet_node.NODE_NAME)
    ready = {c.type: c.status for c in node.status.conditions}["Ready"]
    assert ready == "True"
    assert node.status.allocatable["nvidia.com/gpu"] == str(GPUS_PER_NODE)
    assert node.status.node_info.container_runtime_version.startswith("containerd://")
    assert [(t.key, t.effect) for t in node.spec.taints] == [(kubelet_node.TAINT_KEY, "NoSchedule")]
    assert node.metadata.labels["dynamo.dev/node-kind"] == "kubelet"


async def test_a_pod_runs_restricted_as_the_chart_asks_and_answers_logs_and_exec(
    api: client.ApiClient, testbed: Cluster, namespace: str, node_images: Images
) -> None:
    core = client.CoreV1Api(api)
    body = _pod(
        "restricted",
        node_images["operator"],
        command=["python", "-c", f"print('serving', flush=True); {SERVE}"],
        ports=[{"containerPort": 8080}],
        resources={"limits": {"memory": "128Mi", "nvidia.com/gpu": "1"}},
    )
    await core.create_namespaced_pod(namespace, body)
    pod = await _running(api, namespace, "restricted")

    def run(*command: str) -> str:
        done = kubectl(testbed, "-n", namespace, "exec", "restricted", "--", *command)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    # The user, the capabilities, no privilege escalation, as runc set them.
    assert run("id", "-u") == "10001"
    status = run("cat", "/proc/self/status")
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["CapEff"].strip() == "0000000000000000"
    assert fields["NoNewPrivs"].strip() == "1"
    # A read-only root: the write fails in the container, not in our code.
    refused = kubectl(testbed, "-n", namespace, "exec", "restricted", "--", "touch", "/x")
    assert refused.returncode != 0
    assert "Read-only file system" in refused.stderr
    # The memory limit is the pod's cgroup's, and the GPU came from the device plugin.
    limit = run("cat", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
    assert int(limit) == 128 * 2**20
    assert run("printenv", "NVIDIA_VISIBLE_DEVICES").startswith("GPU-fake-")
    # The token and the memory emptyDir are tmpfs mounts, as the kubelet makes them.
    mounts = run("cat", "/proc/mounts").splitlines()
    tmpfs = {line.split()[1] for line in mounts if line.split()[2] == "tmpfs"}
    assert "/tmp" in tmpfs
    # /var/run is a link to /run in the image: the kernel names the mount by its target.
    assert "/run/secrets/kubernetes.io/serviceaccount" in tmpfs
    assert run("cat", "/var/run/secrets/kubernetes.io/serviceaccount/namespace") == namespace
    # The pod's own status says who it runs as.
    user = pod.status.container_statuses[0].user
    assert user is not None, pod.status.container_statuses[0]
    assert user.linux.uid == 10001
    # Logs through the API server and the real kubelet; the pod network from the host.
    logs = kubectl(testbed, "-n", namespace, "logs", "restricted")
    assert logs.stdout.strip() == "serving", logs.stderr
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://{pod.status.pod_ip}:8080/") as answer,
    ):
        assert answer.status == 200


async def test_a_missing_image_shows_the_kubelets_reason(
    api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api)
    await core.create_namespaced_pod(namespace, _pod("absent", "dynamo-absent:never-built"))

    def waiting_for_the_image(pod: client.V1Pod) -> bool:
        statuses = pod.status.container_statuses or []
        waiting = statuses[0].state.waiting if statuses else None
        return waiting is not None and waiting.reason != "ContainerCreating"

    pod = await eventually(
        lambda: core.read_namespaced_pod("absent", namespace), 60, waiting_for_the_image
    )
    waiting = pod.status.container_statuses[0].state.waiting
    assert waiting.reason == "ErrImageNeverPull", json.dumps(waiting.to_dict())


async def test_a_claim_gets_a_volume_the_kubelet_mounts_and_loses_it_when_deleted(
    api: client.ApiClient, testbed: Cluster, namespace: str, node_images: Images
) -> None:
    core = client.CoreV1Api(api)
    claim: Any = {
        "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    await core.create_namespaced_persistent_volume_claim(namespace, claim)
    body = _pod(
        "writer",
        node_images["operator"],
        command=[
            "python",
            "-c",
            "open('/data/kept', 'w').write('on the volume'); import time; time.sleep(3600)",
        ],
    )
    body["spec"]["containers"][0]["volumeMounts"].append({"name": "data", "mountPath": "/data"})
    body["spec"]["volumes"].append({"name": "data", "persistentVolumeClaim": {"claimName": "data"}})
    await core.create_namespaced_pod(namespace, body)
    await _running(api, namespace, "writer")
    # What a user sees: the claim Bound to a volume of the default class.
    listed = kubectl(testbed, "-n", namespace, "get", "pvc", "data", "--no-headers")
    name, status, volume, capacity, modes, storage_class = listed.stdout.split()[:6]
    assert (name, status, capacity, modes, storage_class) == (
        "data",
        "Bound",
        "1Gi",
        "RWO",
        "testbed-local",
    )
    pv = await core.read_persistent_volume(volume)
    assert pv.spec.claim_ref.name == "data"
    # The kubelet mounted the volume's directory: the pod's write is there on the node.
    kept = await asyncio.to_thread((Path(pv.spec.local.path) / "kept").read_text)
    assert kept == "on the volume"

    await core.delete_namespaced_pod("writer", namespace, grace_period_seconds=0)
    await core.delete_namespaced_persistent_volume_claim("data", namespace)

    async def gone() -> bool:
        try:
            await core.read_persistent_volume(volume)
        except ApiException as exc:
            return exc.status == 404
        return False

    await eventually(gone, 120, bool)
    assert not await asyncio.to_thread(Path(pv.spec.local.path).exists)
