"""The process node: a node agent (what the kubelet does, minus images) that runs the pods
bound to it as local processes, each pod in its own network namespace with its pod IP.

It registers its Node (advertising `nvidia.com/gpu`, tainted so that only pods that tolerate
it land here), renews its Lease, and for each pod bound to it: allocates a pod IP, creates
the pod's network namespace, resolves the env (values, downward-API fields, Secret and
ConfigMap keys), mounts a bound service-account token (and projected ones; `tokens` renews
them before they expire), runs each container's command, runs
its probes, writes the pod's status through `pods/status`, restarts exited containers per the
restart policy, honours readiness gates (Ready waits for each gate's condition, which a
controller writes and this agent never overwrites), and on deletion sends SIGTERM (to the
container's main process, as a container runtime does), waits the grace period, SIGKILLs
every process of the container, removes the namespace and finalizes the pod. Images are
ignored: a container must name its command (which runs with the project venv's `python`
first on PATH, or the venv `layout.image_venvs` maps its image to: vLLM's for the vLLM
worker image).

For the kubelet API (hack/testbed/kubelet, a separate server the API server calls for logs,
exec, attach and port-forward) it keeps each container's output in CRI log files, one per
run, and publishes each pod's processes in `<pod dir>/kubelet.json`. Its policy agent
(policy_agent.py) enforces NetworkPolicy on the pods' veths.

Run it as `python -m testbed.process_node` (hack/cluster does).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime as dt
import ipaddress
import json
import logging
import os
import shutil
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from . import container_logs, cpu_share, network
from .layout import (
    GATEWAY_IP,
    GPUS_PER_NODE,
    HACK_DIR,
    PROCESS_NODE_NAME,
    PROCESS_NODE_POD_CIDR,
    PROCESS_NODE_TAINT_KEY,
    REPO_DIR,
    Layout,
    Ports,
    image_venvs,
    read_versions,
)
from .policy_agent import PolicyAgent
from .tokens import TokenFile, TokenKeeper

log = logging.getLogger("process-node")

LEASE_DURATION_SECONDS = 40
LEASE_RENEW_SECONDS = 10
NODE_STATUS_SECONDS = 60
# The kubelet starts at 10 s and doubles to 5 min; shorter here so tests see restarts quickly.
RESTART_BACKOFF_START = 1.0
RESTART_BACKOFF_MAX = 10.0
SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
LAUNCHER = HACK_DIR / "testbed" / "launcher.py"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _now_micro() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def node_manifest(name: str, kubelet_port: int) -> Any:  # a dict; the client takes dicts
    """The Node this agent registers, with the status a kubelet would report. The API server
    reaches the node's kubelet API (hack/testbed/kubelet) at its InternalIP and
    `daemonEndpoints.kubeletEndpoint.Port`."""
    now = _now()
    capacity = {
        "cpu": "16",
        "memory": "64Gi",
        "ephemeral-storage": "100Gi",
        "pods": "110",
        "nvidia.com/gpu": str(GPUS_PER_NODE),
    }
    conditions = [
        {"type": t, "status": "False", "reason": f"Kubelet{r}", "message": m}
        for t, r, m in (
            ("MemoryPressure", "HasSufficientMemory", "kubelet has sufficient memory"),
            ("DiskPressure", "HasNoDiskPressure", "kubelet has no disk pressure"),
            ("PIDPressure", "HasSufficientPID", "kubelet has sufficient PID available"),
        )
    ]
    conditions.append(
        {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "process node"}
    )
    for c in conditions:
        c["lastHeartbeatTime"] = now
        c["lastTransitionTime"] = now
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "dynamo.dev/node-kind": "process",
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": "Process-Node-Virtual-GPU",
                "nvidia.com/gpu.count": str(GPUS_PER_NODE),
            },
        },
        "spec": {
            "podCIDR": PROCESS_NODE_POD_CIDR,
            "podCIDRs": [PROCESS_NODE_POD_CIDR],
            "taints": [{"key": PROCESS_NODE_TAINT_KEY, "value": "true", "effect": "NoSchedule"}],
        },
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": conditions,
            "addresses": [
                {"type": "InternalIP", "address": GATEWAY_IP},
                {"type": "Hostname", "address": name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": read_versions()["K8S_VERSION"],
                "kubeProxyVersion": "",
                "containerRuntimeVersion": "process://local",
                "osImage": "dynamo test bed process node",
                "kernelVersion": os.uname().release,
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        },
    }


class IpPool:
    """Pod IPs from the node's pod CIDR (.1 is left for a gateway, as is customary)."""

    def __init__(self, cidr: str) -> None:
        hosts = list(ipaddress.ip_network(cidr).hosts())
        self._free = [str(ip) for ip in hosts[1:]]
        self._used: set[str] = set()

    def take(self) -> str:
        for ip in self._free:
            if ip not in self._used:
                self._used.add(ip)
                return ip
        raise RuntimeError("process node: pod CIDR exhausted")

    def give_back(self, ip: str) -> None:
        self._used.discard(ip)


@dataclass
class Probe:
    """One container probe and its counters, as the kubelet keeps them."""

    spec: dict[str, Any]
    success: bool = False
    consecutive_ok: int = 0
    consecutive_fail: int = 0


@dataclass
class Container:
    name: str
    spec: dict[str, Any]
    process: asyncio.subprocess.Process | None = None
    restart_count: int = 0
    started_at: str | None = None
    started: bool = False
    ready: bool = False
    last_terminated: dict[str, Any] | None = None
    terminated: dict[str, Any] | None = None
    waiting_reason: str | None = None
    waiting_message: str | None = None
    # The number of its latest run, which names that run's log file (-1: not run yet).
    run_number: int = -1

    def log_numbers(self) -> tuple[int, int]:
        """The log files `kubectl logs` reads without and with --previous, as the kubelet
        picks them: while waiting to restart, both are the run that exited last."""
        if self.waiting_reason == "CrashLoopBackOff":
            return self.run_number, self.run_number
        return self.run_number, self.run_number - 1


@dataclass
class PodRun:
    """Everything the agent tracks for one pod it runs."""

    namespace: str
    name: str
    uid: str
    pod_ip: str
    netns: str
    directory: Path
    containers: list[Container] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    start_time: str = field(default_factory=_now)
    terminating: bool = False
    status_dirty: asyncio.Event = field(default_factory=asyncio.Event)
    # `spec.readinessGates` condition types, and the latest status of each as some controller
    # wrote it into `status.conditions` (absent: not written yet, which counts as False).
    readiness_gates: tuple[str, ...] = ()
    gate_statuses: dict[str, str] = field(default_factory=dict)
    # Each pod condition's latest status and when it last changed (the kubelet's
    # `lastTransitionTime`), by condition type.
    transitions: dict[str, tuple[str, str]] = field(default_factory=dict)


class ProcessNode:
    """The agent. `api` is built by the caller from the admin kubeconfig."""

    def __init__(self, api: client.ApiClient, layout: Layout, ports: Ports, node_name: str):
        self.api = api
        self.core = client.CoreV1Api(api)
        self.coordination = client.CoordinationV1Api(api)
        self.layout = layout
        self.ports = ports
        self.node_name = node_name
        self.ips = IpPool(PROCESS_NODE_POD_CIDR)
        self.pods: dict[str, PodRun] = {}  # by uid
        self.node_uid = ""
        self.image_venvs = image_venvs()
        self.policy = PolicyAgent(api, node_name, self._local_pods)
        self.tokens = TokenKeeper(self.core)

    def _local_pods(self) -> dict[str, tuple[str, str]]:
        return {uid: (network.veth_name(uid), run.pod_ip) for uid, run in self.pods.items()}

    # --- node ----------------------------------------------------------------------------

    async def register(self) -> None:
        manifest = node_manifest(self.node_name, self.ports.kubelet)
        try:
            node = await self.core.create_node(manifest)
        except ApiException as exc:
            if exc.status != 409:
                raise
            await self.core.patch_node_status(self.node_name, {"status": manifest["status"]})
            node = await self.core.read_node(self.node_name)
        self.node_uid = node.metadata.uid
        log.info("registered node %s", self.node_name)

    async def heartbeat(self) -> None:
        """Renew the Lease every 10 s and refresh the Ready condition every minute."""
        last_status = asyncio.get_running_loop().time()
        while True:
            # As the kubelet, the node outlives an API server that is gone for a while (the
            # fault suite restarts it): a failed renewal is tried again at the next beat.
            try:
                await self._renew_lease()
                if asyncio.get_running_loop().time() - last_status >= NODE_STATUS_SECONDS:
                    status = node_manifest(self.node_name, self.ports.kubelet)["status"]
                    conditions = status["conditions"]
                    await self.core.patch_node_status(
                        self.node_name, {"status": {"conditions": conditions}}
                    )
                    last_status = asyncio.get_running_loop().time()
            except (ApiException, TimeoutError, aiohttp.ClientError) as exc:
                log.warning("node heartbeat failed: %r; again in %s s", exc, LEASE_RENEW_SECONDS)
            await asyncio.sleep(LEASE_RENEW_SECONDS)

    async def _renew_lease(self) -> None:
        body: Any = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.node_name,
                "namespace": "kube-node-lease",
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "name": self.node_name,
                        "uid": self.node_uid,
                    }
                ],
            },
            "spec": {
                "holderIdentity": self.node_name,
                "leaseDurationSeconds": LEASE_DURATION_SECONDS,
                "renewTime": _now_micro(),
            },
        }
        try:
            await self.coordination.patch_namespaced_lease(
                self.node_name, "kube-node-lease", {"spec": {"renewTime": _now_micro()}}
            )
        except ApiException as exc:
            if exc.status != 404:
                log.warning("lease renewal failed: %s", exc.reason)
                return
            await self.coordination.create_namespaced_lease("kube-node-lease", body)

    # --- pods ----------------------------------------------------------------------------

    async def watch_pods(self) -> None:
        """List and watch the pods bound to this node and act on each change (level-based)."""
        selector = f"spec.nodeName={self.node_name}"
        while True:
            try:
                listing = await self.core.list_pod_for_all_namespaces(field_selector=selector)
                seen = {p.metadata.uid for p in listing.items}
                for pod in listing.items:
                    await self.on_pod(pod)
                for uid in list(self.pods):
                    if uid not in seen:
                        await self.forget(uid)
                version = listing.metadata.resource_version
                async with watch.Watch() as w:
                    async for event in w.stream(
                        self.core.list_pod_for_all_namespaces,
                        field_selector=selector,
                        resource_version=version,
                        timeout_seconds=300,
                    ):
                        pod = event["object"]
                        if event["type"] == "DELETED":
                            await self.forget(pod.metadata.uid)
                        elif event["type"] in ("ADDED", "MODIFIED"):
                            await self.on_pod(pod)
            except ApiException as exc:
                if exc.status != 410:  # 410 Gone: the watch expired; list again.
                    log.warning("pod watch failed: %s; relisting", exc.reason)
                    await asyncio.sleep(1)
            except (TimeoutError, aiohttp.ClientError) as exc:
                log.warning("pod watch interrupted: %r; relisting", exc)
                await asyncio.sleep(1)

    async def on_pod(self, pod: client.V1Pod) -> None:
        uid = pod.metadata.uid
        run = self.pods.get(uid)
        if pod.metadata.deletion_timestamp is not None:
            if run and not run.terminating:
                run.terminating = True
                grace = pod.metadata.deletion_grace_period_seconds
                if grace is None:
                    grace = pod.spec.termination_grace_period_seconds or 30
                run.tasks.append(asyncio.create_task(self.terminate(run, grace)))
            elif run is None:
                await self.finalize(pod.metadata.namespace, pod.metadata.name, uid)
            return
        if run is None and (pod.status.phase or "Pending") == "Pending":
            await self.start_pod(pod)
        elif run is not None:
            self._observe_gates(run, pod)

    def _observe_gates(self, run: PodRun, pod: client.V1Pod) -> None:
        """Keep the statuses of the pod's readiness-gate conditions (written by controllers,
        never by this agent) and recompute Ready when one changed."""
        if not run.readiness_gates:
            return
        statuses = {
            c.type: c.status for c in pod.status.conditions or [] if c.type in run.readiness_gates
        }
        if statuses != run.gate_statuses:
            run.gate_statuses = statuses
            run.status_dirty.set()

    async def start_pod(self, pod: client.V1Pod) -> None:
        meta = pod.metadata
        pod_ip = self.ips.take()
        directory = self.layout.pods / meta.uid
        directory.mkdir(parents=True, exist_ok=True)
        netns = await asyncio.to_thread(network.create_pod_network, meta.uid, pod_ip)
        raw = self.api.sanitize_for_serialization(pod)
        run = PodRun(meta.namespace, meta.name, meta.uid, pod_ip, netns, directory)
        run.readiness_gates = tuple(g.condition_type for g in pod.spec.readiness_gates or [])
        self._observe_gates(run, pod)
        self.pods[meta.uid] = run
        log.info("pod %s/%s: ip %s netns %s", meta.namespace, meta.name, pod_ip, netns)
        try:
            await self.policy.sync()
            binds = await self._volumes(raw, run)
            for spec in raw["spec"]["containers"]:
                container = Container(spec["name"], spec)
                run.containers.append(container)
                env = await self._env(raw, spec, run)
                run.tasks.append(
                    asyncio.create_task(self.supervise(raw, run, container, env, binds))
                )
        except Exception as exc:  # a pod that cannot start is reported, not fatal to the node
            log.exception("pod %s/%s cannot start", meta.namespace, meta.name)
            run.containers = [Container(s["name"], s) for s in raw["spec"]["containers"]]
            for c in run.containers:
                c.waiting_reason, c.waiting_message = "CreateContainerConfigError", str(exc)
        run.tasks.append(asyncio.create_task(self.status_writer(run)))
        run.status_dirty.set()

    async def _volumes(self, pod: dict[str, Any], run: PodRun) -> list[tuple[str, str]]:
        """Host directories to bind into the pod: the service-account token (when mounted) and
        emptyDir volumes at each container's mount paths."""
        binds: list[tuple[str, str]] = []
        spec = pod["spec"]
        sa = spec.get("serviceAccountName") or "default"
        due: dict[TokenFile, float] = {}  # every token file of the pod, and when to renew it
        if spec.get("automountServiceAccountToken", True):
            token_dir = run.directory / "serviceaccount"
            token_dir.mkdir(exist_ok=True)
            token = TokenFile(token_dir / "token", run.namespace, sa, run.name, run.uid, (), 86400)
            due[token] = await self.tokens.issue(token)
            shutil.copy(self.layout.pki / "ca.crt", token_dir / "ca.crt")
            (token_dir / "namespace").write_text(run.namespace)
            binds.append((str(token_dir), SA_MOUNT))
        binds += await self._projected_tokens(pod, run, due)
        run.tasks.append(asyncio.create_task(self.tokens.keep_fresh(due)))
        empty_dirs = {v["name"] for v in spec.get("volumes") or [] if "emptyDir" in v}
        for container in spec["containers"]:
            for mount in container.get("volumeMounts") or []:
                if mount["name"] not in empty_dirs:
                    continue
                if self._would_hide_host_paths(mount["mountPath"], run):
                    # Pods here are host processes: an emptyDir over /tmp would hide the repo,
                    # the venv or the pod's own directory when they live below it. The
                    # process then writes to the host path instead.
                    log.info(
                        "pod %s/%s: not mounting emptyDir %s over %s (host paths below)",
                        run.namespace,
                        run.name,
                        mount["name"],
                        mount["mountPath"],
                    )
                    continue
                host = run.directory / "volumes" / mount["name"]
                host.mkdir(parents=True, exist_ok=True)
                binds.append((str(host), mount["mountPath"]))
        return binds

    async def _projected_tokens(
        self, pod: dict[str, Any], run: PodRun, due: dict[TokenFile, float]
    ) -> list[tuple[str, str]]:
        """Projected volumes made only of serviceAccountToken sources (a token for an audience
        of the pod's choosing, e.g. the operator's for its workers); each token goes into
        `due`, to be renewed before it expires (`tokens.TokenKeeper`)."""
        spec = pod["spec"]
        sa = spec.get("serviceAccountName") or "default"
        found: dict[str, Path] = {}
        for volume in spec.get("volumes") or []:
            sources = (volume.get("projected") or {}).get("sources") or []
            if not sources or not all("serviceAccountToken" in s for s in sources):
                continue
            folder = run.directory / "volumes" / volume["name"]
            folder.mkdir(parents=True, exist_ok=True)
            for source in sources:
                token_spec = source["serviceAccountToken"]
                token = TokenFile(
                    folder / token_spec["path"], run.namespace, sa, run.name, run.uid,
                    audiences=(token_spec["audience"],) if token_spec.get("audience") else (),
                    expiration_seconds=int(token_spec.get("expirationSeconds") or 3600),
                )  # fmt: skip
                due[token] = await self.tokens.issue(token)
            found[volume["name"]] = folder
        return [
            (str(found[mount["name"]]), mount["mountPath"])
            for container in spec["containers"]
            for mount in container.get("volumeMounts") or []
            if mount["name"] in found
        ]

    def _would_hide_host_paths(self, mount_path: str, run: PodRun) -> bool:
        target = Path(mount_path).resolve()
        needed = [
            Path(sys.prefix),
            Path(sys.executable).parent,
            REPO_DIR,
            self.layout.root,
            run.directory,
            *self.image_venvs.values(),
        ]
        return any(path.resolve().is_relative_to(target) for path in needed)

    async def _env(
        self, pod: dict[str, Any], container: dict[str, Any], run: PodRun
    ) -> dict[str, str]:
        env: dict[str, str] = {
            # The agent's own interpreter first: `python` in a pod is the project's venv (or
            # the venv its image maps to).
            "PATH": f"{self._bin_dir(container)}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HOME": str(run.directory),
            "HOSTNAME": run.name,
            # As the kubelet does for the `kubernetes` Service; the ClusterIP routes nowhere
            # without kube-proxy, so point at the API server's own address.
            "KUBERNETES_SERVICE_HOST": GATEWAY_IP,
            "KUBERNETES_SERVICE_PORT": str(self.ports.apiserver),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(self.ports.apiserver),
        }
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix", "")
            if "secretRef" in source:
                data = await self._secret(run.namespace, source["secretRef"]["name"])
            else:
                data = await self._configmap(run.namespace, source["configMapRef"]["name"])
            env.update({prefix + k: v for k, v in data.items()})
        for var in container.get("env") or []:
            if "valueFrom" not in var:
                env[var["name"]] = _expand(var.get("value", ""), env)
                continue
            source = var["valueFrom"]
            if "fieldRef" in source:
                env[var["name"]] = self._field(pod, source["fieldRef"]["fieldPath"], run)
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                env[var["name"]] = (await self._secret(run.namespace, ref["name"]))[ref["key"]]
            elif "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                env[var["name"]] = (await self._configmap(run.namespace, ref["name"]))[ref["key"]]
            elif "resourceFieldRef" in source:
                resources = container.get("resources") or {}
                kind, _, res = source["resourceFieldRef"]["resource"].partition(".")
                env[var["name"]] = str((resources.get(kind) or {}).get(res, "0"))
        return env

    def _bin_dir(self, container: dict[str, Any]) -> Path:
        venv = self.image_venvs.get(container.get("image", ""))
        return venv / "bin" if venv is not None else Path(sys.executable).parent

    def _field(self, pod: dict[str, Any], path: str, run: PodRun) -> str:
        meta = pod["metadata"]
        simple = {
            "metadata.name": run.name,
            "metadata.namespace": run.namespace,
            "metadata.uid": run.uid,
            "spec.nodeName": self.node_name,
            "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
            "status.podIP": run.pod_ip,
            "status.podIPs": run.pod_ip,
            "status.hostIP": GATEWAY_IP,
            "status.hostIPs": GATEWAY_IP,
        }
        if path in simple:
            return simple[path]
        for kind in ("labels", "annotations"):
            prefix = f"metadata.{kind}['"
            if path.startswith(prefix) and path.endswith("']"):
                return str((meta.get(kind) or {}).get(path[len(prefix) : -2], ""))
        raise ValueError(f"unsupported fieldRef {path!r}")

    async def _secret(self, namespace: str, name: str) -> dict[str, str]:
        secret = await self.core.read_namespaced_secret(name, namespace)
        data = {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
        data.update(secret.string_data or {})
        return data

    async def _configmap(self, namespace: str, name: str) -> dict[str, str]:
        return dict((await self.core.read_namespaced_config_map(name, namespace)).data or {})

    # --- containers ----------------------------------------------------------------------

    async def supervise(
        self,
        pod: dict[str, Any],
        run: PodRun,
        container: Container,
        env: dict[str, str],
        binds: list[tuple[str, str]],
    ) -> None:
        """Run the container, restart it per the restart policy, and run its probes."""
        policy = pod["spec"].get("restartPolicy", "Always")
        command = (container.spec.get("command") or []) + (container.spec.get("args") or [])
        if not container.spec.get("command"):
            container.waiting_reason = "CreateContainerError"
            container.waiting_message = (
                "the process node ignores images: the container must set `command`"
            )
            run.status_dirty.set()
            return
        image = container.spec.get("image", "")
        python = self._bin_dir(container.spec) / "python"
        if image in self.image_venvs and not python.exists():
            container.waiting_reason = "CreateContainerError"
            container.waiting_message = (
                f"the process node runs image {image} with {python}, which is missing "
                "(hack/vllm-venv makes it)"
            )
            run.status_dirty.set()
            return
        command = [_expand(part, env) for part in command]
        backoff = RESTART_BACKOFF_START
        raw_log = run.directory / f"{container.name}.log"
        stdin = _stdin_fifo(run, container)
        if stdin and not stdin.exists():
            os.mkfifo(stdin, 0o600)
        while not run.terminating:
            argv = ["ip", "netns", "exec", run.netns, sys.executable, str(LAUNCHER)]
            for src, dst in binds:
                argv += ["--bind", src, dst]
            argv += ["--cwd", container.spec.get("workingDir") or str(run.directory), "--"]
            # Read-write: the FIFO then always has a writer, so the container never sees its
            # stdin end between two `kubectl attach` sessions.
            stdin_fd = os.open(stdin, os.O_RDWR) if stdin else asyncio.subprocess.DEVNULL
            try:
                container.process = await asyncio.create_subprocess_exec(
                    *argv,
                    *command,
                    stdin=stdin_fd,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    env=env,
                    start_new_session=True,
                )
            finally:
                if stdin:
                    os.close(stdin_fd)
            # Out of the agent's system group (which it would inherit): a busy engine must
            # not take the control plane's CPU share.
            cpu_share.place(container.process.pid, cpu_share.PODS)
            container.run_number = container.restart_count
            cri_log = run.directory / "logs" / container.name / f"{container.run_number}.log"
            copying = asyncio.create_task(
                container_logs.copy_output(container.process, raw_log, cri_log)
            )
            container.started_at = _now()
            container.terminated = None
            container.waiting_reason = None
            container.ready = False
            probes = asyncio.create_task(self.run_probes(run, container))
            run.status_dirty.set()
            code = await container.process.wait()
            probes.cancel()
            await container_logs.finish(copying)
            container.ready = False
            container.started = False
            finished = {
                "exitCode": code if code >= 0 else 128 - code,
                "reason": "Completed" if code == 0 else "Error",
                "startedAt": container.started_at,
                "finishedAt": _now(),
            }
            if run.terminating:
                container.terminated = finished
                run.status_dirty.set()
                return
            if policy == "Never" or (policy == "OnFailure" and code == 0):
                container.terminated = finished
                run.status_dirty.set()
                return
            container.last_terminated = finished
            container.restart_count += 1
            container.waiting_reason = "CrashLoopBackOff"
            container.waiting_message = f"back-off {backoff:.0f}s restarting failed container"
            run.status_dirty.set()
            log.info(
                "pod %s/%s container %s exited %s; restarting in %.0fs",
                run.namespace,
                run.name,
                container.name,
                code,
                backoff,
            )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RESTART_BACKOFF_MAX)

    async def run_probes(self, run: PodRun, container: Container) -> None:
        spec = container.spec
        startup = Probe(spec["startupProbe"]) if spec.get("startupProbe") else None
        readiness = Probe(spec["readinessProbe"]) if spec.get("readinessProbe") else None
        liveness = Probe(spec["livenessProbe"]) if spec.get("livenessProbe") else None
        if startup and not await self._probe_until(run, container, startup, want_success=True):
            await self._kill_for_restart(container, "startup probe failed")
            return
        container.started = True
        if readiness is None:
            container.ready = True
        run.status_dirty.set()
        tasks = []
        if readiness:
            tasks.append(asyncio.create_task(self._readiness_loop(run, container, readiness)))
        if liveness:
            tasks.append(asyncio.create_task(self._liveness_loop(run, container, liveness)))
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()

    async def _probe_until(
        self, run: PodRun, container: Container, probe: Probe, want_success: bool
    ) -> bool:
        await asyncio.sleep(probe.spec.get("initialDelaySeconds", 0))
        threshold = probe.spec.get("failureThreshold", 3)
        while True:
            if run.terminating:
                return True  # as the kubelet: no startup probe once deletion is requested
            ok = await self._check(run, container, probe.spec)
            if ok == want_success:
                return True
            probe.consecutive_fail += 1
            if probe.consecutive_fail >= threshold:
                return False
            await asyncio.sleep(probe.spec.get("periodSeconds", 10))

    async def _readiness_loop(self, run: PodRun, container: Container, probe: Probe) -> None:
        await asyncio.sleep(probe.spec.get("initialDelaySeconds", 0))
        while True:
            ok = await self._check(run, container, probe.spec)
            if ok:
                probe.consecutive_ok += 1
                probe.consecutive_fail = 0
                if probe.consecutive_ok >= probe.spec.get("successThreshold", 1):
                    self._set_ready(run, container, True)
            else:
                probe.consecutive_fail += 1
                probe.consecutive_ok = 0
                if probe.consecutive_fail >= probe.spec.get("failureThreshold", 3) or (
                    not container.ready
                ):
                    self._set_ready(run, container, False)
            await asyncio.sleep(probe.spec.get("periodSeconds", 10))

    async def _liveness_loop(self, run: PodRun, container: Container, probe: Probe) -> None:
        await asyncio.sleep(probe.spec.get("initialDelaySeconds", 0))
        while True:
            # As the kubelet: once deletion is requested, liveness stops (a draining server
            # may answer its liveness path with 503 and must not be killed for it).
            if run.terminating:
                return
            if await self._check(run, container, probe.spec):
                probe.consecutive_fail = 0
            else:
                probe.consecutive_fail += 1
                if probe.consecutive_fail >= probe.spec.get("failureThreshold", 3):
                    await self._kill_for_restart(container, "liveness probe failed")
                    return
            await asyncio.sleep(probe.spec.get("periodSeconds", 10))

    def _set_ready(self, run: PodRun, container: Container, ready: bool) -> None:
        if container.ready != ready:
            container.ready = ready
            run.status_dirty.set()

    async def _kill_for_restart(self, container: Container, why: str) -> None:
        log.info("container %s: %s; killing it for a restart", container.name, why)
        if container.process and container.process.returncode is None:
            _signal_group(container.process.pid, signal.SIGKILL)

    async def _check(self, run: PodRun, container: Container, spec: dict[str, Any]) -> bool:
        timeout = spec.get("timeoutSeconds", 1)
        try:
            if "httpGet" in spec:
                get = spec["httpGet"]
                port = _port(get["port"], container.spec)
                scheme = get.get("scheme", "HTTP").lower()
                url = f"{scheme}://{run.pod_ip}:{port}{get.get('path', '/')}"
                session_timeout = aiohttp.ClientTimeout(total=timeout)
                async with (
                    aiohttp.ClientSession(timeout=session_timeout) as session,
                    session.get(url, ssl=False) as resp,
                ):
                    return 200 <= resp.status < 400
            if "tcpSocket" in spec:
                port = _port(spec["tcpSocket"]["port"], container.spec)
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(run.pod_ip, port), timeout
                )
                writer.close()
                return True
            if "exec" in spec:
                proc = await asyncio.create_subprocess_exec(
                    "ip",
                    "netns",
                    "exec",
                    run.netns,
                    *spec["exec"]["command"],
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                )
                return await asyncio.wait_for(proc.wait(), timeout) == 0
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False
        return False

    # --- status --------------------------------------------------------------------------

    async def status_writer(self, run: PodRun) -> None:
        """Write the pod's status whenever something changed (coalescing bursts).

        A dict body goes out as a strategic merge patch, which merges `status.conditions` by
        `type`: the conditions other writers own (readiness gates) stay as they are."""
        last: dict[str, Any] | None = None
        while True:
            await run.status_dirty.wait()
            run.status_dirty.clear()
            # Before the status: once a pod shows Running, `kubectl exec` finds its process.
            _publish_for_kubelet_api(run)
            status = self.pod_status(run)
            if status == last:
                continue
            try:
                await self.core.patch_namespaced_pod_status(
                    run.name, run.namespace, {"status": status}
                )
                last = status
            except ApiException as exc:
                if exc.status == 404:
                    return
                log.warning("status of %s/%s not written: %s", run.namespace, run.name, exc.reason)
                await asyncio.sleep(1)
                run.status_dirty.set()
            except (TimeoutError, aiohttp.ClientError) as exc:
                log.warning("status of %s/%s not written: %r", run.namespace, run.name, exc)
                await asyncio.sleep(1)
                run.status_dirty.set()

    def pod_status(self, run: PodRun) -> dict[str, Any]:
        statuses = []
        for c in run.containers:
            state: dict[str, Any]
            if c.terminated:
                state = {"terminated": c.terminated}
            elif c.waiting_reason or c.process is None:
                state = {
                    "waiting": {
                        "reason": c.waiting_reason or "ContainerCreating",
                        **({"message": c.waiting_message} if c.waiting_message else {}),
                    }
                }
            else:
                state = {"running": {"startedAt": c.started_at}}
            entry: dict[str, Any] = {
                "name": c.name,
                "image": c.spec.get("image", ""),
                "imageID": "",
                "containerID": f"process://{run.uid}/{c.name}",
                "ready": c.ready,
                "started": c.started,
                "restartCount": c.restart_count,
                "state": state,
            }
            if c.last_terminated:
                entry["lastState"] = {"terminated": c.last_terminated}
            statuses.append(entry)
        unready = [c.name for c in run.containers if not c.ready]
        all_ready = bool(run.containers) and not unready
        done = bool(run.containers) and all(c.terminated for c in run.containers)
        if done:
            failed = any(c.terminated and c.terminated["exitCode"] != 0 for c in run.containers)
            phase = "Failed" if failed else "Succeeded"
        elif any(c.process is not None for c in run.containers):
            phase = "Running"
        else:
            phase = "Pending"

        def cond(
            kind: str, ok: bool, reason: str | None = None, message: str | None = None
        ) -> dict[str, str | None]:
            # reason and message always go out, null when unset: a merge patch keeps the
            # fields it does not name, so a stale reason would outlive its condition.
            status = "True" if ok else "False"
            previous = run.transitions.get(kind)
            if previous is None or previous[0] != status:
                run.transitions[kind] = (status, _now())
            return {
                "type": kind,
                "status": status,
                "reason": None if ok else reason,
                "message": None if ok else message,
                "lastTransitionTime": run.transitions[kind][1],
            }

        unready_message = f"containers with unready status: [{' '.join(unready)}]"
        containers_ready = cond("ContainersReady", all_ready, "ContainersNotReady", unready_message)
        # As the kubelet: Ready is ContainersReady, then held back by any readiness gate whose
        # condition is not True.
        gates_held = self._gate_messages(run)
        if not all_ready:
            ready = cond("Ready", False, "ContainersNotReady", unready_message)
        elif run.terminating:
            ready = cond("Ready", False)
        elif gates_held:
            ready = cond("Ready", False, "ReadinessGatesNotReady", ", ".join(gates_held))
        else:
            ready = cond("Ready", True)
        return {
            "phase": phase,
            "hostIP": GATEWAY_IP,
            "hostIPs": [{"ip": GATEWAY_IP}],
            "podIP": run.pod_ip,
            "podIPs": [{"ip": run.pod_ip}],
            "startTime": run.start_time,
            "conditions": [
                cond("PodReadyToStartContainers", True),
                cond("Initialized", True),
                containers_ready,
                ready,
            ],
            "containerStatuses": statuses,
        }

    @staticmethod
    def _gate_messages(run: PodRun) -> list[str]:
        """Why each readiness gate holds Ready back (the kubelet's wording); empty when all
        gates' conditions are True."""
        messages = []
        for gate in run.readiness_gates:
            status = run.gate_statuses.get(gate)
            if status is None:
                messages.append(
                    f'corresponding condition of pod readiness gate "{gate}" does not exist.'
                )
            elif status != "True":
                messages.append(
                    f'the status of pod readiness gate "{gate}" is not "True", but {status}'
                )
        return messages

    # --- termination ---------------------------------------------------------------------

    async def terminate(self, run: PodRun, grace: int) -> None:
        """SIGTERM, wait the grace period, SIGKILL, clean up, then finalize the pod."""
        log.info("pod %s/%s: terminating (grace %ss)", run.namespace, run.name, grace)
        run.status_dirty.set()
        await self._stop_processes(run, grace)
        await self._cleanup(run)
        await self.finalize(run.namespace, run.name, run.uid)

    async def _stop_processes(self, run: PodRun, grace: float) -> None:
        procs = [c.process for c in run.containers if c.process and c.process.returncode is None]
        for proc in procs:
            # As a container runtime does: SIGTERM to the container's main process only (its
            # PID 1), so that children it manages (vLLM's engine core) keep serving while it
            # drains; SIGKILL to all of them after the grace period.
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
        if procs:
            waits = [asyncio.create_task(p.wait()) for p in procs]
            _, pending = await asyncio.wait(waits, timeout=max(grace, 0.1))
            if pending:
                for proc in procs:
                    _signal_group(proc.pid, signal.SIGKILL)
                await asyncio.wait(waits, timeout=5)

    async def _cleanup(self, run: PodRun) -> None:
        for task in run.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        await asyncio.to_thread(network.delete_pod_network, run.uid, run.pod_ip)
        self.ips.give_back(run.pod_ip)
        self.pods.pop(run.uid, None)

    async def forget(self, uid: str) -> None:
        """The pod object is gone (force-deleted): stop its processes at once."""
        run = self.pods.get(uid)
        if run is None or run.terminating:
            return
        run.terminating = True
        await self._stop_processes(run, 0)
        await self._cleanup(run)

    async def finalize(self, namespace: str, name: str, uid: str) -> None:
        body: Any = {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
        with contextlib.suppress(ApiException):
            await self.core.delete_namespaced_pod(name, namespace, body=body)
        shutil.rmtree(self.layout.pods / uid, ignore_errors=True)

    async def shutdown(self) -> None:
        """Stop every pod's processes and remove their namespaces (the node is going away)."""
        for run in list(self.pods.values()):
            run.terminating = True
            await self._stop_processes(run, 5)
            await self._cleanup(run)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def _port(port: int | str, container: dict[str, Any]) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"named port {port!r} not declared by the container")


def _stdin_fifo(run: PodRun, container: Container) -> Path | None:
    """The FIFO a container with `stdin: true` reads, which `kubectl attach` writes."""
    return run.directory / f"{container.name}.stdin" if container.spec.get("stdin") else None


def _publish_for_kubelet_api(run: PodRun) -> None:
    """Write the pod's kubelet.json, what the kubelet API (hack/testbed/kubelet) knows of it:
    each container's running process and which log files are its current and previous."""
    containers = {}
    for c in run.containers:
        running = c.process is not None and c.process.returncode is None
        current, previous = c.log_numbers()
        stdin = _stdin_fifo(run, c)
        containers[c.name] = {
            "pid": c.process.pid if c.process is not None and running else 0,
            "log": current,
            "previousLog": previous,
            "stdin": str(stdin) if stdin else "",
        }
    state = {
        "namespace": run.namespace,
        "name": run.name,
        "uid": run.uid,
        "netns": run.netns,
        "containers": containers,
    }
    path = run.directory / "kubelet.json"
    path.with_suffix(".tmp").write_text(json.dumps(state))
    path.with_suffix(".tmp").replace(path)


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion for env values, command and args."""
    for key, val in env.items():
        value = value.replace(f"$({key})", val)
    return value


async def amain(layout: Layout, node_name: str) -> None:
    await config.load_kube_config(config_file=str(layout.kubeconfig))
    async with client.ApiClient() as api:
        node = ProcessNode(api, layout, Ports(), node_name)
        await node.register()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        tasks = [
            asyncio.create_task(node.heartbeat()),
            asyncio.create_task(node.watch_pods()),
            asyncio.create_task(node.policy.run()),
        ]
        stopper: asyncio.Task[Any] = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        for task in done:
            if task is not stopper and task.exception():
                log.error("agent loop failed: %r", task.exception())
        await node.shutdown()
        await node.policy.remove()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="testbed.process_node")
    parser.add_argument("--node-name", default=PROCESS_NODE_NAME)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(amain(Layout.from_env(), args.node_name))


if __name__ == "__main__":
    main()
