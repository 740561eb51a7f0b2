"""The process node's NetworkPolicy agent, what a CNI's policy agent does: it watches
NetworkPolicies, pods and namespaces, translates them (hack/testbed/network_policy.py) into
nftables rules on the local pods' veths, and replaces the test bed's table atomically
whenever the result changes. The process node also syncs before it starts a pod's
containers, so a new pod's rules (and its address in its peers' rules) are in place before
it sends or receives anything. Only this node's pods are peers: pods on KWOK nodes run
nothing and their addresses are unreachable, so leaving them out changes no verdict and
spares a list of every pod in the cluster on each change."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from . import network_policy

log = logging.getLogger("policy-agent")

# Bursts of pod updates (status writes) coalesce into one sync.
SETTLE_SECONDS = 0.1

# uid -> (veth, pod IP) of the pods this node runs.
LocalPods = Callable[[], Mapping[str, tuple[str, str]]]


async def apply(script: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        "nft", "-f", "-", stdin=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate(script.encode())
    if proc.returncode != 0:
        raise RuntimeError(f"nft rejected the NetworkPolicy rules: {err.decode()}\n{script}")


class PolicyAgent:
    def __init__(self, api: client.ApiClient, node_name: str, local_pods: LocalPods) -> None:
        self.api = api
        self.on_this_node = f"spec.nodeName={node_name}"
        self.core = client.CoreV1Api(api)
        self.networking = client.NetworkingV1Api(api)
        self.local_pods = local_pods
        self._lock = asyncio.Lock()
        self._dirty = asyncio.Event()
        self._applied: str | None = None

    async def sync(self) -> None:
        """Bring the table in line with the cluster now."""
        async with self._lock:
            policies = (await self.networking.list_network_policy_for_all_namespaces()).items
            if policies:
                listing = await self.core.list_pod_for_all_namespaces(
                    field_selector=self.on_this_node
                )
                pods = listing.items
                namespaces = (await self.core.list_namespace()).items
            else:  # the usual case: nothing to enforce, and no need to read the pods
                pods, namespaces = [], []
            local = self.local_pods()
            pod_dicts = [self._with_local_ip(self._plain(p), local) for p in pods]
            rules = network_policy.translate(
                [self._plain(p) for p in policies],
                pod_dicts,
                [self._plain(n) for n in namespaces],
                {uid: veth for uid, (veth, _) in local.items()},
            )
            script = network_policy.render(rules)
            if script != self._applied:
                await apply(script)
                self._applied = script
                log.info("NetworkPolicy: %d isolated pods", len(rules))

    def _plain(self, obj: Any) -> dict[str, Any]:
        return dict(self.api.sanitize_for_serialization(obj))

    @staticmethod
    def _with_local_ip(pod: dict[str, Any], local: Mapping[str, tuple[str, str]]) -> dict[str, Any]:
        """A local pod's IP is known before its status says so (it is assigned at start)."""
        known = local.get(pod["metadata"]["uid"])
        if known and not (pod.get("status") or {}).get("podIP"):
            pod["status"] = {**(pod.get("status") or {}), "podIP": known[1]}
        return pod

    async def run(self) -> None:
        """Watch the three kinds and sync after each burst of changes."""
        watches = [
            asyncio.create_task(self._watch(lister, **selector))
            for lister, selector in (
                (self.networking.list_network_policy_for_all_namespaces, {}),
                (self.core.list_pod_for_all_namespaces, {"field_selector": self.on_this_node}),
                (self.core.list_namespace, {}),
            )
        ]
        try:
            while True:
                await self._dirty.wait()
                await asyncio.sleep(SETTLE_SECONDS)
                self._dirty.clear()
                try:
                    await self.sync()
                except (ApiException, aiohttp.ClientError, RuntimeError) as exc:
                    log.warning("NetworkPolicy sync failed: %s; retrying", exc)
                    await asyncio.sleep(1)
                    self._dirty.set()
        finally:
            for task in watches:
                task.cancel()

    async def _watch(self, lister: Callable[..., Any], **selector: str) -> None:
        while True:
            try:
                async with watch.Watch() as w:
                    async for _ in w.stream(lister, timeout_seconds=300, **selector):
                        self._dirty.set()
            except (ApiException, TimeoutError, aiohttp.ClientError) as exc:
                log.warning("watch for NetworkPolicy failed: %r; again", exc)
                await asyncio.sleep(1)

    async def remove(self) -> None:
        """Drop the table (the node is going away)."""
        async with self._lock:
            await apply(network_policy.render([]))
            self._applied = None
