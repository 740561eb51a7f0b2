"""The test bed is a real cluster: scheduling onto fake GPU nodes, garbage collection,
authorization, CEL validation, and real processes behind real EndpointSlices."""

from __future__ import annotations

import asyncio
import collections
import errno
import ipaddress
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from support.cluster import REPO, Cluster, eventually, hack_cluster
from support.testbed_kubectl import kubectl

pytestmark = pytest.mark.cluster

sys.path.insert(0, str(REPO / "hack"))
from testbed import kubelet_node, network  # noqa: E402
from testbed.layout import (  # noqa: E402
    GUARDED_RANGE,
    PROCESS_NODE_TAINT_KEY,
    SERVICE_CIDR,
    Layout,
)

PROCESS_NODE_TOLERATION = {"key": PROCESS_NODE_TAINT_KEY, "operator": "Exists"}


def _pod_ready(pod: client.V1Pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


async def _pods(api: client.ApiClient, namespace: str, selector: str) -> list[client.V1Pod]:
    listing = await client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=selector)
    return list(listing.items)


async def test_gpu_deployment_lands_on_fake_gpu_nodes_and_is_garbage_collected(
    api: client.ApiClient, namespace: str
) -> None:
    apps = client.AppsV1Api(api)
    labels = {"app": "gpu-sleeper"}
    deployment: Any = {
        "metadata": {"name": "gpu-sleeper", "labels": labels},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {
                            "name": "main",
                            "image": "registry.invalid/never-pulled:1",
                            "resources": {"limits": {"nvidia.com/gpu": "1"}},
                        }
                    ]
                },
            },
        },
    }
    await apps.create_namespaced_deployment(namespace, deployment)

    pods = await eventually(
        lambda: _pods(api, namespace, "app=gpu-sleeper"),
        90,
        until=lambda ps: len(ps) == 3 and all(_pod_ready(p) for p in ps),
    )
    for pod in pods:
        assert pod.spec.node_name.startswith("kwok-gpu-"), pod.spec.node_name
        assert ipaddress.ip_address(pod.status.pod_ip) in GUARDED_RANGE
    node = await client.CoreV1Api(api).read_node(pods[0].spec.node_name)
    assert node.status.allocatable["nvidia.com/gpu"] == "8"
    assert node.metadata.labels["nvidia.com/gpu.product"]

    await apps.delete_namespaced_deployment("gpu-sleeper", namespace)
    await eventually(
        lambda: apps.list_namespaced_replica_set(namespace),
        60,
        until=lambda rs: not rs.items,
    )
    await eventually(lambda: _pods(api, namespace, "app=gpu-sleeper"), 60, until=lambda ps: not ps)


async def test_authorization_is_enforced(
    api: client.ApiClient, cluster: Cluster, namespace: str
) -> None:
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    sa: Any = {"metadata": {"name": "reader"}}
    role: Any = {
        "metadata": {"name": "get-pods"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}],
    }
    binding: Any = {
        "metadata": {"name": "reader-get-pods"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "get-pods"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
    }
    await core.create_namespaced_service_account(namespace, sa)
    await rbac.create_namespaced_role(namespace, role)
    await rbac.create_namespaced_role_binding(namespace, binding)
    token_request: Any = {"spec": {"audiences": [], "expirationSeconds": 600}}
    token = (
        await core.create_namespaced_service_account_token("reader", namespace, token_request)
    ).status.token

    cfg = client.Configuration()
    cfg.host = api.configuration.host
    cfg.ssl_ca_cert = api.configuration.ssl_ca_cert
    cfg.api_key = {"BearerToken": token}
    cfg.api_key_prefix = {"BearerToken": "Bearer"}
    async with client.ApiClient(cfg) as as_reader:
        reader = client.CoreV1Api(as_reader)
        with pytest.raises(ApiException) as missing:
            await reader.read_namespaced_pod("no-such-pod", namespace)
        assert missing.value.status == 404  # allowed to get: the pod just does not exist
        pod: Any = {
            "metadata": {"name": "forbidden"},
            "spec": {"containers": [{"name": "c", "image": "x"}]},
        }
        with pytest.raises(ApiException) as denied:
            await reader.create_namespaced_pod(namespace, pod)
        assert denied.value.status == 403
        assert "cannot create resource" in json.loads(denied.value.body or b"{}")["message"]


async def test_cel_validation_rejects_with_the_rules_message(
    api: client.ApiClient, namespace: str
) -> None:
    ext = client.ApiextensionsV1Api(api)
    group = f"{namespace}.testbed.dynamo.dev"
    crd: Any = {
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "properties": {
                                        "min": {"type": "integer"},
                                        "max": {"type": "integer"},
                                    },
                                    "x-kubernetes-validations": [
                                        {
                                            "rule": "self.min <= self.max",
                                            "message": "spec.min must not exceed spec.max",
                                        }
                                    ],
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    await ext.create_custom_resource_definition(crd)
    try:
        custom = client.CustomObjectsApi(api)

        async def create(spec: dict[str, int], name: str) -> Any:
            body = {
                "apiVersion": f"{group}/v1",
                "kind": "Widget",
                "metadata": {"name": name},
                "spec": spec,
            }
            return await custom.create_namespaced_custom_object(
                group, "v1", namespace, "widgets", body
            )

        # The CRD serves once Established; creating the valid object proves it.
        await eventually(lambda: create({"min": 1, "max": 2}, "good"), 30)
        with pytest.raises(ApiException) as refused:
            await create({"min": 3, "max": 2}, "bad")
        assert refused.value.status == 422
        message = json.loads(refused.value.body or b"{}")["message"]
        assert "spec.min must not exceed spec.max" in message
    finally:
        await ext.delete_custom_resource_definition(f"widgets.{group}")


def _http_server_pod(name: str, port: int) -> Any:
    return {
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "tolerations": [PROCESS_NODE_TOLERATION],
            "nodeSelector": {"dynamo.dev/node-kind": "process"},
            "terminationGracePeriodSeconds": 5,
            # An emptyDir over the repository's parent (like a pod's writable /tmp when the
            # checkout lives in /tmp): the process node must not hide the venv it runs.
            "volumes": [{"name": "scratch", "emptyDir": {}}],
            "containers": [
                {
                    "name": "main",
                    "image": "python:3.11",
                    "command": ["python", "-m", "http.server", str(port)],
                    "volumeMounts": [{"name": "scratch", "mountPath": str(REPO.parent)}],
                    "ports": [{"name": "http", "containerPort": port}],
                    "readinessProbe": {
                        "httpGet": {"path": "/", "port": "http"},
                        "periodSeconds": 1,
                    },
                }
            ],
        },
    }


async def test_process_node_pod_serves_at_its_endpointslice_address(
    api: client.ApiClient, testbed: Cluster, namespace: str
) -> None:
    core, discovery = client.CoreV1Api(api), client.DiscoveryV1Api(api)
    await core.create_namespaced_pod(namespace, _http_server_pod("web", 8080))
    service: Any = {
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": "http"}]},
    }
    await core.create_namespaced_service(namespace, service)

    def ready_address(slices: Any) -> str | None:
        for s in slices.items:
            for endpoint in s.endpoints or []:
                if endpoint.conditions.ready:
                    return str(endpoint.addresses[0])
        return None

    slices = await eventually(
        lambda: discovery.list_namespaced_endpoint_slice(
            namespace, label_selector="kubernetes.io/service-name=web"
        ),
        90,
        until=lambda s: ready_address(s) is not None,
    )
    address = ready_address(slices)
    assert address is not None
    port = slices.items[0].ports[0].port
    pod = await core.read_namespaced_pod("web", namespace)
    assert address == pod.status.pod_ip
    assert pod.spec.node_name.startswith("process-node")

    def get() -> int:
        with urllib.request.urlopen(f"http://{address}:{port}/", timeout=5) as resp:
            return int(resp.status)

    assert await asyncio.to_thread(get) == 200

    netns = network.netns_name(pod.metadata.uid)
    assert netns in network.namespaces()
    routes = (
        await asyncio.to_thread(
            subprocess.run, ["ip", "-n", netns, "route"], capture_output=True, text=True
        )
    ).stdout
    assert "default" not in routes, f"a pod must reach only the guarded range: {routes}"

    # Another pod reaches this one at its pod IP, as a frontend reaches its workers.
    fetch = f"import urllib.request; urllib.request.urlopen('http://{address}:{port}/', timeout=5)"
    client_pod: Any = {
        "metadata": {"name": "client"},
        "spec": {
            "tolerations": [PROCESS_NODE_TOLERATION],
            "nodeSelector": {"dynamo.dev/node-kind": "process"},
            "restartPolicy": "Never",
            "containers": [
                {"name": "main", "image": "python:3.11", "command": ["python", "-c", fetch]}
            ],
        },
    }
    await core.create_namespaced_pod(namespace, client_pod)
    finished = await eventually(
        lambda: core.read_namespaced_pod("client", namespace),
        60,
        until=lambda p: p.status.phase in ("Succeeded", "Failed"),
    )
    assert finished.status.phase == "Succeeded"
    await core.delete_namespaced_pod("client", namespace)
    await core.delete_namespaced_pod("web", namespace)
    await eventually(lambda: core.list_namespaced_pod(namespace), 60, until=lambda p: not p.items)
    assert netns not in network.namespaces()
    assert not _listening(address, port)


GATE = "example.com/gate"


def _status(pod: client.V1Pod, kind: str) -> str | None:
    found = next((c for c in pod.status.conditions or [] if c.type == kind), None)
    return None if found is None else str(found.status)


def _ready_condition(pod: client.V1Pod) -> client.V1PodCondition:
    found = next((c for c in pod.status.conditions or [] if c.type == "Ready"), None)
    assert found is not None, f"no Ready condition: {pod.status.conditions}"
    return found


async def test_readiness_gate_holds_ready_until_its_condition_is_true(
    api: client.ApiClient, testbed: Cluster, namespace: str
) -> None:
    """As the kubelet: Ready needs ContainersReady and every readiness gate's condition True;
    the gate condition, which a controller writes, survives the node's own status writes."""
    core, discovery = client.CoreV1Api(api), client.DiscoveryV1Api(api)
    # The readiness probe reads /ready from a directory the test controls (a pod's processes
    # see the host's files), so the test can flip the container's readiness.
    served = Path(testbed.kubeconfig).parent / "e2e" / f"{namespace}-gated"
    served.mkdir(parents=True, exist_ok=True)
    (served / "ready").write_text("ok")
    pod = _http_server_pod("gated", 8080)
    pod["spec"]["readinessGates"] = [{"conditionType": GATE}]
    container = pod["spec"]["containers"][0]
    container["command"] = ["python", "-m", "http.server", "8080", "--directory", str(served)]
    container["readinessProbe"] = {
        "httpGet": {"path": "/ready", "port": "http"},
        "periodSeconds": 1,
        "failureThreshold": 1,
    }
    service: Any = {
        "metadata": {"name": "gated"},
        "spec": {"selector": {"app": "gated"}, "ports": [{"port": 80, "targetPort": "http"}]},
    }
    await core.create_namespaced_service(namespace, service)
    await core.create_namespaced_pod(namespace, pod)

    def read() -> Any:
        return core.read_namespaced_pod("gated", namespace)

    async def set_gate(status: str) -> None:
        body: Any = {"status": {"conditions": [{"type": GATE, "status": status}]}}
        await core.patch_namespaced_pod_status("gated", namespace, body)

    async def endpoint_ready() -> bool | None:
        slices = await discovery.list_namespaced_endpoint_slice(
            namespace, label_selector="kubernetes.io/service-name=gated"
        )
        for s in slices.items:
            for endpoint in s.endpoints or []:
                return bool(endpoint.conditions.ready)
        return None

    try:
        # Containers ready, the gate's condition absent: not Ready.
        held = await eventually(read, 90, until=lambda p: _status(p, "ContainersReady") == "True")
        ready = _ready_condition(held)
        assert ready.status == "False", ready
        assert ready.reason == "ReadinessGatesNotReady", ready
        assert f'"{GATE}" does not exist' in str(ready.message), ready
        assert await eventually(endpoint_ready, 30, until=lambda r: r is not None) is False

        # The controller sets the gate: Ready, and the endpoint with it.
        await set_gate("True")
        opened = await eventually(read, 30, until=lambda p: _status(p, "Ready") == "True")
        ready = _ready_condition(opened)
        # The reason it was held back went with it (not left behind by the merge).
        assert ready.reason is None, ready
        assert ready.message is None, ready
        await eventually(endpoint_ready, 30, until=lambda r: r is True)

        # The container turns unready and ready again: the node writes its conditions twice
        # and the gate's condition stays as the controller wrote it.
        (served / "ready").unlink()
        flipped = await eventually(read, 30, until=lambda p: _status(p, "Ready") == "False")
        assert _status(flipped, "ContainersReady") == "False"
        assert _ready_condition(flipped).reason == "ContainersNotReady"
        assert _status(flipped, GATE) == "True"
        # Each condition has the time its status last changed, as the kubelet writes it.
        opened_at = _ready_condition(opened).last_transition_time
        assert opened_at is not None
        assert _ready_condition(flipped).last_transition_time >= opened_at
        initialized = next(c for c in flipped.status.conditions if c.type == "Initialized")
        assert initialized.last_transition_time <= opened_at
        (served / "ready").write_text("ok")
        back = await eventually(read, 30, until=lambda p: _status(p, "Ready") == "True")
        assert _status(back, GATE) == "True"

        # The controller clears the gate: not Ready, though the containers still are.
        await set_gate("False")
        closed = await eventually(read, 30, until=lambda p: _status(p, "Ready") == "False")
        assert _status(closed, "ContainersReady") == "True"
        ready = _ready_condition(closed)
        assert ready.reason == "ReadinessGatesNotReady", ready
        assert f'"{GATE}" is not "True", but False' in str(ready.message), ready
        assert _status(closed, GATE) == "False"
        await eventually(endpoint_ready, 30, until=lambda r: r is False)
    finally:
        (served / "ready").unlink(missing_ok=True)
        served.rmdir()


# A server whose liveness path answers 200 until SIGTERM, then 503 while it "drains" for 3 s
# and finally writes a marker file: what a draining worker does.
_DRAINING_SERVER = """
import http.server, signal, sys, threading, time
draining = threading.Event()
class Live(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503 if draining.is_set() else 200)
        self.end_headers()
def on_term(*_):
    draining.set()
    threading.Thread(target=finish).start()
def finish():
    time.sleep(3)
    open(sys.argv[1], "w").write("drained")
    server.shutdown()
signal.signal(signal.SIGTERM, on_term)
server = http.server.ThreadingHTTPServer(("0.0.0.0", 8080), Live)
server.serve_forever()
"""


async def test_liveness_is_not_probed_once_deletion_is_requested(
    api: client.ApiClient, testbed: Cluster, namespace: str, tmp_path: Path
) -> None:
    # As the kubelet: a pod being deleted gets its grace period even when its liveness probe
    # fails meanwhile (a draining server may answer it with 503).
    core = client.CoreV1Api(api)
    marker = Path(testbed.kubeconfig).parent / "e2e" / f"{namespace}-drained"
    marker.parent.mkdir(parents=True, exist_ok=True)
    probe = {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1, "failureThreshold": 1}
    pod: Any = {
        "metadata": {"name": "drainer"},
        "spec": {
            "tolerations": [PROCESS_NODE_TOLERATION],
            "nodeSelector": {"dynamo.dev/node-kind": "process"},
            "terminationGracePeriodSeconds": 30,
            "containers": [
                {
                    "name": "main",
                    "image": "python:3.11",
                    "command": ["python", "-c", _DRAINING_SERVER, str(marker)],
                    "startupProbe": {**probe, "failureThreshold": 30},
                    "livenessProbe": probe,
                    "readinessProbe": probe,
                }
            ],
        },
    }
    await core.create_namespaced_pod(namespace, pod)
    await eventually(lambda: core.read_namespaced_pod("drainer", namespace), 60, _pod_ready)
    await core.delete_namespaced_pod("drainer", namespace)
    await eventually(lambda: core.list_namespaced_pod(namespace), 60, until=lambda p: not p.items)
    try:
        assert marker.read_text() == "drained", "the pod was killed before it finished draining"
    finally:
        marker.unlink(missing_ok=True)


def _listening(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=3).close()
    except OSError:
        return False
    return True


# Answers GET with its pod's name, so a test sees which pod behind a Service answered.
NAME_SERVER = (
    "import http.server, os\n"
    "class Name(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = os.environ['POD_NAME'].encode()\n"
    "        self.send_response(200)\n"
    "        self.send_header('Content-Length', str(len(body)))\n"
    "        self.end_headers()\n"
    "        self.wfile.write(body)\n"
    "http.server.ThreadingHTTPServer(('', int(os.environ['PORT'])), Name).serve_forever()\n"
)


def _name_server_pod(name: str, app: str, port: int) -> Any:
    pod = _http_server_pod(name, port)
    pod["metadata"]["labels"] = {"app": app}
    container = pod["spec"]["containers"][0]
    container["command"] = ["python", "-c", NAME_SERVER]
    container["env"] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "PORT", "value": str(port)},
    ]
    return pod


def _ready_addresses(slices: Any) -> list[str]:
    return [
        str(endpoint.addresses[0])
        for s in slices.items
        for endpoint in s.endpoints or []
        if endpoint.conditions.ready
    ]


async def _service_with_ready_endpoints(
    api: client.ApiClient, namespace: str, name: str, app: str, ready: int
) -> str:
    """Create a ClusterIP Service (port 80 to the pods' `http` port) over the pods labelled
    `app`; return its cluster IP once its EndpointSlices list `ready` ready endpoints."""
    service: Any = {
        "metadata": {"name": name},
        "spec": {
            "selector": {"app": app},
            "ports": [{"name": "web", "port": 80, "targetPort": "http"}],
        },
    }
    created = await client.CoreV1Api(api).create_namespaced_service(namespace, service)
    cluster_ip = str(created.spec.cluster_ip)
    assert ipaddress.ip_address(cluster_ip) in ipaddress.ip_network(SERVICE_CIDR)
    await eventually(
        lambda: client.DiscoveryV1Api(api).list_namespaced_endpoint_slice(
            namespace, label_selector=f"kubernetes.io/service-name={name}"
        ),
        90,
        until=lambda s: len(_ready_addresses(s)) == ready,
    )
    return cluster_ip


def _get_body(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


async def test_cluster_ip_reaches_ready_pods_round_robin_from_host_and_pods(
    api: client.ApiClient, testbed: Cluster, namespace: str
) -> None:
    """The service proxy routes a ClusterIP, as kube-proxy would, from the host and from a
    pod, to each ready pod in turn."""
    core = client.CoreV1Api(api)
    names = {"echo-0", "echo-1"}
    for name in sorted(names):
        await core.create_namespaced_pod(namespace, _name_server_pod(name, "echo", 8080))
    cluster_ip = await _service_with_ready_endpoints(api, namespace, "echo", "echo", 2)
    url = f"http://{cluster_ip}:80/"

    async def four_answers() -> list[str]:
        return [await asyncio.to_thread(_get_body, url) for _ in range(4)]

    # The proxy follows the slices by watch: wait until it forwards to both pods.
    await eventually(four_answers, 30, until=lambda bodies: set(bodies) == names)
    assert cluster_ip in network.service_addresses()
    answers = [await asyncio.to_thread(_get_body, url) for _ in range(6)]
    assert collections.Counter(answers) == {"echo-0": 3, "echo-1": 3}, answers

    # A pod reaches the Service at its cluster IP (its route to the guarded range leads to
    # the host, where the proxy listens).
    fetch = (
        "import urllib.request\n"
        f"body = urllib.request.urlopen('{url}', timeout=5).read().decode()\n"
        "print('answered by', body)\n"
        f"raise SystemExit(0 if body in {sorted(names)!r} else 3)\n"
    )
    client_pod: Any = {
        "metadata": {"name": "service-client"},
        "spec": {
            "tolerations": [PROCESS_NODE_TOLERATION],
            "nodeSelector": {"dynamo.dev/node-kind": "process"},
            "restartPolicy": "Never",
            "containers": [
                {"name": "main", "image": "python:3.11", "command": ["python", "-c", fetch]}
            ],
        },
    }
    await core.create_namespaced_pod(namespace, client_pod)
    finished = await eventually(
        lambda: core.read_namespaced_pod("service-client", namespace),
        60,
        until=lambda p: p.status.phase in ("Succeeded", "Failed"),
    )
    state = finished.status.container_statuses[0].state.terminated
    assert finished.status.phase == "Succeeded", f"exit {state.exit_code}"


def _connection_failure(address: str, port: int) -> tuple[OSError | None, float]:
    """Connect and read: the error (refused, reset, unreachable, or the peer closing at
    once) and how long it took to show, or None when the Service answered."""
    started = time.monotonic()
    try:
        with socket.create_connection((address, port), timeout=10) as sock:
            sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
            if sock.recv(1):
                return None, time.monotonic() - started
            failure: OSError = ConnectionAbortedError("closed without an answer")
    except OSError as exc:
        failure = exc
    return failure, time.monotonic() - started


async def test_service_without_ready_endpoints_refuses_and_deleted_service_loses_its_address(
    api: client.ApiClient, testbed: Cluster, namespace: str
) -> None:
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    template = _http_server_pod("scaled", 8080)
    deployment: Any = {
        "metadata": {"name": "scaled"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "scaled"}},
            "template": {"metadata": template["metadata"], "spec": template["spec"]},
        },
    }
    await apps.create_namespaced_deployment(namespace, deployment)
    cluster_ip = await _service_with_ready_endpoints(api, namespace, "scaled", "scaled", 1)
    await eventually(lambda: asyncio.to_thread(_get_body, f"http://{cluster_ip}:80/"), 30)

    scale: Any = {"spec": {"replicas": 0}}
    await apps.patch_namespaced_deployment_scale("scaled", namespace, scale)
    failure, elapsed = await eventually(
        lambda: asyncio.to_thread(_connection_failure, cluster_ip, 80),
        60,
        until=lambda result: result[0] is not None,
    )
    # Rejected at once, as kube-proxy does, not left to time out.
    assert not isinstance(failure, TimeoutError), f"timed out after {elapsed:.1f}s"
    assert elapsed < 2, f"{failure!r} took {elapsed:.1f}s"
    assert isinstance(failure, ConnectionError), repr(failure)
    # The Service still exists: its address stays and refuses, it is not unreachable.
    assert cluster_ip in network.service_addresses()
    refused, _ = await asyncio.to_thread(_connection_failure, cluster_ip, 80)
    assert isinstance(refused, ConnectionRefusedError), repr(refused)

    await core.delete_namespaced_service("scaled", namespace)
    await eventually(
        lambda: asyncio.to_thread(network.service_addresses),
        30,
        until=lambda addresses: cluster_ip not in addresses,
    )
    gone, _ = await asyncio.to_thread(_connection_failure, cluster_ip, 80)
    # Back to the guarded range's unreachable route.
    assert gone is not None
    assert gone.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH), repr(gone)


async def test_pod_service_account_token_reaches_the_api_server(
    api: client.ApiClient, testbed: Cluster, namespace: str
) -> None:
    """A process-node pod calls the API server with its mounted, bound token (what a worker
    pod writing its DynamoWorkerMetadata will do)."""
    core = client.CoreV1Api(api)
    script = (
        "import os, ssl, urllib.request, urllib.error\n"
        "d = '/var/run/secrets/kubernetes.io/serviceaccount'\n"
        "token = open(d + '/token').read(); ns = open(d + '/namespace').read()\n"
        "ctx = ssl.create_default_context(cafile=d + '/ca.crt')\n"
        "url = 'https://%s:%s/api/v1/namespaces/%s/pods' % (os.environ['KUBERNETES_SERVICE_HOST'],"
        " os.environ['KUBERNETES_SERVICE_PORT'], ns)\n"
        "req = urllib.request.Request(url, headers={'Authorization': 'Bearer ' + token})\n"
        "try:\n"
        "    urllib.request.urlopen(req, context=ctx)\n"
        "    raise SystemExit(10)\n"
        "except urllib.error.HTTPError as e:\n"
        "    print('status', e.code, os.environ['POD_NAME'])\n"
        "    raise SystemExit(0 if e.code == 403 else 11)\n"
    )
    pod: Any = {
        "metadata": {"name": "token-user"},
        "spec": {
            "tolerations": [PROCESS_NODE_TOLERATION],
            "nodeSelector": {"dynamo.dev/node-kind": "process"},
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": "python:3.11",
                    "command": ["python", "-c", script],
                    "env": [
                        {
                            "name": "POD_NAME",
                            "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                        }
                    ],
                }
            ],
        },
    }
    await core.create_namespaced_pod(namespace, pod)
    done = await eventually(
        lambda: core.read_namespaced_pod("token-user", namespace),
        90,
        until=lambda p: p.status.phase in ("Succeeded", "Failed"),
    )
    # 403 (not 401): the token authenticated as the pod's ServiceAccount, which may not list.
    state = done.status.container_statuses[0].state.terminated
    assert done.status.phase == "Succeeded", f"exit {state.exit_code}"


async def test_connection_to_a_kwok_pod_fails_at_once(
    api: client.ApiClient, testbed: Cluster, namespace: str
) -> None:
    pod: Any = {
        "metadata": {"name": "ghost"},
        "spec": {
            "nodeSelector": {"type": "kwok"},
            "containers": [{"name": "main", "image": "registry.invalid/ghost:1"}],
        },
    }
    core = client.CoreV1Api(api)
    await core.create_namespaced_pod(namespace, pod)
    running = await eventually(
        lambda: core.read_namespaced_pod("ghost", namespace), 60, until=_pod_ready
    )
    ip = running.status.pod_ip
    assert ipaddress.ip_address(ip) in GUARDED_RANGE
    started = time.monotonic()
    try:
        socket.create_connection((ip, 80), timeout=10).close()
        failure: OSError | None = None
    except OSError as exc:
        failure = exc
    elapsed = time.monotonic() - started
    assert failure is not None, f"something answered at {ip}"
    # Refused by the host's unreachable route, not a timeout: the packet never left.
    assert not isinstance(failure, TimeoutError), f"timed out after {elapsed:.1f}s"
    assert failure.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ECONNREFUSED)


def test_kubectl_reports_the_pinned_version(cluster: Cluster) -> None:
    versions = (REPO / "hack" / "versions.env").read_text()
    pinned = next(
        line.split("=", 1)[1] for line in versions.splitlines() if line.startswith("K8S_VERSION=")
    )
    out = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    if cluster.is_testbed:
        assert out["serverVersion"]["gitVersion"] == pinned
        assert out["clientVersion"]["gitVersion"] == pinned


@pytest.mark.order_last
def test_down_leaves_nothing_and_up_is_warm(testbed: Cluster) -> None:
    """`down` stops every process and removes the network (the NetworkPolicy table among it:
    a policy isolates a running pod then); a warm `up` brings it all back.

    Runs last in the session (see conftest ordering) since it restarts the test bed."""
    pids_dir = Path(testbed.kubeconfig).parent / "pids"
    pids = [int(p.read_text()) for p in pids_dir.glob("*.pid")]
    assert pids, "the test bed records its daemons' pids"
    _isolate_a_pod(testbed)
    result = hack_cluster("down")
    assert result.returncode == 0, result.stderr
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid), f"pid {pid} still runs"
    assert network.leftovers() == []
    layout = Layout(Path(testbed.kubeconfig).parent)
    assert kubelet_node.leftovers(layout) == []
    for host_path in kubelet_node.BOUND.values():
        # Bound over inside the node's private mount namespace only: the host's stay as they were.
        assert not Path(host_path).exists() or not any(Path(host_path).iterdir()), host_path
    started = time.monotonic()
    result = hack_cluster("up")
    assert result.returncode == 0, result.stderr
    print(f"warm `hack/cluster up` took {time.monotonic() - started:.1f}s")
    assert (
        subprocess.run(
            [str(REPO / "hack" / "cluster"), "status"], capture_output=True, check=False
        ).returncode
        == 0
    )


def _isolate_a_pod(testbed: Cluster) -> None:
    """A process-node pod under a deny-all NetworkPolicy, so the policy table exists."""
    manifest = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": {"name": "deny-all", "namespace": "default"},
                "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]},
            },
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "isolated", "namespace": "default"},
                "spec": {
                    "tolerations": [PROCESS_NODE_TOLERATION],
                    "nodeSelector": {"dynamo.dev/node-kind": "process"},
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "main", "image": "x", "command": ["sleep", "600"]}],
                },
            },
        ],
    }
    applied = kubectl(testbed, "apply", "-f", "-", stdin=json.dumps(manifest))
    assert applied.returncode == 0, applied.stderr
    waited = testbed.kubectl(
        "-n",
        "default",
        "wait",
        "--for=condition=Ready",
        "pod/isolated",
        "--timeout=60s",
        check=False,
    )
    assert waited.returncode == 0, waited.stderr
    assert network.nft_tables() == ["ip dtb_netpol"]


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True
