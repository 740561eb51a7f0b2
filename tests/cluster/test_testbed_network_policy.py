"""The process node enforces NetworkPolicy on its pods' veths: ingress and egress rules
that admit only pods labelled `x` on port 9090, and access restored once the policy goes.
Connections are made from inside the pods with `kubectl exec`."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio import client

from support.cluster import Cluster, eventually
from support.testbed_kubectl import kubectl

pytestmark = pytest.mark.cluster

# Every pod serves on 9090 and 8080, so each can be a server and, through exec, a client.
SERVE = """
import http.server, threading
for port in (9090, 8080):
    server = http.server.ThreadingHTTPServer(("", port), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever).start()
"""
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()
except OSError as exc:
    print(type(exc).__name__, exc)
    sys.exit(1)
"""
# The pods: `a` is labelled x, `b` is not, `s` is the one the policies select.
LABELS = {"a": {"x": "yes"}, "b": {}, "s": {"role": "guarded"}}


def _pod(name: str) -> Any:
    return {
        "metadata": {"name": name, "labels": LABELS[name]},
        "spec": {
            "tolerations": [{"key": "dynamo.dev/process-node", "operator": "Exists"}],
            "nodeSelector": {"dynamo.dev/node-kind": "process"},
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": "python:3.11",
                    "command": ["python", "-c", SERVE],
                    "readinessProbe": {"tcpSocket": {"port": 9090}, "periodSeconds": 1},
                }
            ],
        },
    }


class Pods:
    def __init__(self, cluster: Cluster, namespace: str, ips: dict[str, str]) -> None:
        self.cluster, self.namespace, self.ips = cluster, namespace, ips

    async def connects(self, source: str, target: str, port: int) -> bool:
        """Whether a TCP connection from pod `source` to pod `target`'s IP succeeds."""
        result = await asyncio.to_thread(
            kubectl,
            self.cluster,
            "-n",
            self.namespace,
            "exec",
            source,
            "--",
            "python",
            "-c",
            CONNECT,
            self.ips[target],
            str(port),
        )
        assert result.returncode in (0, 1), result.stderr
        if result.returncode == 1:
            assert "ConnectionRefusedError" in result.stdout, result.stdout  # rejected, not lost
        return result.returncode == 0

    async def reachability(self, *paths: tuple[str, str, int]) -> list[bool]:
        return [await self.connects(*path) for path in paths]


@pytest_asyncio.fixture(scope="module")
async def pods(api: client.ApiClient, testbed: Cluster) -> AsyncIterator[Pods]:
    core = client.CoreV1Api(api)
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    await core.create_namespace({"metadata": {"name": namespace}})  # type: ignore[arg-type]
    await eventually(lambda: core.read_namespaced_service_account("default", namespace), 30)
    for name in LABELS:
        await core.create_namespaced_pod(namespace, _pod(name))
    ips = {}
    for name in LABELS:
        ready = await eventually(
            lambda n=name: core.read_namespaced_pod(n, namespace),  # type: ignore[misc]
            60,
            until=lambda p: any(
                c.type == "Ready" and c.status == "True" for c in p.status.conditions or []
            ),
        )
        ips[name] = ready.status.pod_ip
    yield Pods(testbed, namespace, ips)
    await core.delete_namespace(namespace)


async def _check_policy(
    api: client.ApiClient, pods: Pods, policy: Any, paths: list[tuple[str, str, int]]
) -> None:
    """`paths` are (source, target, port): the first allowed by `policy`, the others
    refused while it exists; all open before and after."""
    networking = client.NetworkingV1Api(api)
    assert await pods.reachability(*paths) == [True] * len(paths)
    await networking.create_namespaced_network_policy(pods.namespace, policy)
    expected = [True] + [False] * (len(paths) - 1)
    # The policy agent follows policies by watch: wait for it to apply this one.
    await eventually(lambda: pods.reachability(*paths), 20, until=lambda got: got == expected)
    await networking.delete_namespaced_network_policy(policy["metadata"]["name"], pods.namespace)
    await eventually(lambda: pods.reachability(*paths), 20, until=lambda got: all(got))


def _only_x_on_9090(direction: str) -> Any:
    """A policy on the `role: guarded` pod: in `direction` (Ingress or Egress), only pods
    labelled x on port 9090."""
    peers = "from" if direction == "Ingress" else "to"
    return {
        "metadata": {"name": f"{direction.lower()}-x-9090"},
        "spec": {
            "podSelector": {"matchLabels": {"role": "guarded"}},
            "policyTypes": [direction],
            direction.lower(): [
                {peers: [{"podSelector": {"matchLabels": {"x": "yes"}}}], "ports": [{"port": 9090}]}
            ],
        },
    }


async def test_ingress_admits_only_labelled_pods_on_the_port(
    api: client.ApiClient, pods: Pods
) -> None:
    # a (x) -> s:9090 admitted; b (no x) -> s:9090 and a -> s:8080 refused.
    paths = [("a", "s", 9090), ("b", "s", 9090), ("a", "s", 8080)]
    await _check_policy(api, pods, _only_x_on_9090("Ingress"), paths)


async def test_egress_reaches_only_labelled_pods_on_the_port(
    api: client.ApiClient, pods: Pods
) -> None:
    # s -> a (x):9090 allowed; s -> b:9090 and s -> a:8080 refused.
    paths = [("s", "a", 9090), ("s", "b", 9090), ("s", "a", 8080)]
    await _check_policy(api, pods, _only_x_on_9090("Egress"), paths)
