"""`hack/cluster up | down | status | env`: the test bed's command line."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from . import cpu_share, daemons, kubelet_node, network
from .controlplane import Component, components, kubelet_api, kwok_stages
from .layout import (
    GPUS_PER_NODE,
    HACK_DIR,
    KWOK_NODE_COUNT,
    KWOK_POD_CIDR_TEMPLATE,
    PROCESS_NODE_NAME,
    Layout,
    Ports,
    read_versions,
    server_url,
)
from .pki import KUBELET_CLIENT_USER, ensure_pki, write_admin_kubeconfig

AGENT = "process-node"
KUBELET_API = "kubelet-api"
PROXY = "service-proxy"
VOLUMES = "volume-provisioner"
# Stop order: the process node first (it stops its pods, which may use Services until they
# exit), its kubelet API, the service proxy, then the control plane top-down.
STOP_ORDER = [
    AGENT,
    KUBELET_API,
    PROXY,
    VOLUMES,
    "kwok",
    "kube-scheduler",
    "kube-controller-manager",
    "kube-apiserver",
    "etcd",
]
READY_TIMEOUT = {"etcd": 30, "kube-apiserver": 120}
# After a kube-apiserver restart the controller-manager and the scheduler watch again on
# client-go's reflector backoff (up to 30 s, jittered up to twice that).
CONTROLLERS_BACK_TIMEOUT = 120.0


def say(message: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _built(script: str) -> Path:
    """The path a build script prints last (it builds only what its cache lacks)."""
    result = subprocess.run(
        [str(HACK_DIR / script)], stdout=subprocess.PIPE, text=True, check=False
    )
    if result.returncode != 0:
        raise SystemExit(f"hack/{script} failed (see its output above)")
    return Path(result.stdout.strip().splitlines()[-1])


def resolve_bin_dir() -> Path:
    """Binaries from $DYNAMO_K8S_BIN_DIR, the cache, or a build (hack/build-binaries)."""
    return _built("build-binaries")


def _gomodcache() -> Path:
    cache = Path(os.environ.get("DYNAMO_TESTBED_CACHE", Path.home() / ".cache/dynamo-testbed"))
    return cache / "gomod"


def _start(layout: Layout, component: Component) -> None:
    say(f"starting {component.name}")
    daemons.start(layout, component.name, component.argv)
    if not daemons.wait_for(component.ready, READY_TIMEOUT.get(component.name, 60), 0.2):
        raise SystemExit(
            f"{component.name} did not become ready; see {layout.logs / component.name}.log"
        )


def kwok_node(index: int) -> Any:  # a plain dict; the client accepts dicts as bodies
    """A fake GPU node as KWOK manages it: 8 GPUs, the labels GPU Feature Discovery sets."""
    name = f"kwok-gpu-{index}"
    capacity = {
        "cpu": "64",
        "memory": "512Gi",
        "ephemeral-storage": "1Ti",
        "pods": "110",
        "nvidia.com/gpu": str(GPUS_PER_NODE),
    }
    cidr = KWOK_POD_CIDR_TEMPLATE.format(n=16 + index)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "type": "kwok",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "node.kubernetes.io/instance-type": "fake-8xh100",
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                "nvidia.com/gpu.count": str(GPUS_PER_NODE),
                "nvidia.com/gpu.memory": "81559",
            },
            "annotations": {"kwok.x-k8s.io/node": "fake"},
        },
        "spec": {"podCIDR": cidr, "podCIDRs": [cidr]},
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            # Inside the guarded range: nothing listens there, so connections fail at once.
            "addresses": [
                {"type": "InternalIP", "address": f"198.18.2.{index + 10}"},
                {"type": "Hostname", "address": name},
            ],
        },
    }


async def _create_nodes_and_wait(layout: Layout, within: float) -> None:
    await config.load_kube_config(config_file=str(layout.kubeconfig))
    async with client.ApiClient() as api:
        core = client.CoreV1Api(api)
        for i in range(KWOK_NODE_COUNT):
            try:
                await core.create_node(kwok_node(i))
            except ApiException as exc:
                if exc.status != 409:
                    raise

        async def missing() -> str | None:
            # The kubelet node is awaited once started, after these; its Node object outlives
            # a test bed that was killed rather than brought down.
            nodes = [
                n
                for n in (await core.list_node()).items
                if n.metadata.name != kubelet_node.NODE_NAME
            ]
            pending = [n.metadata.name for n in nodes if not _schedulable(n)]
            if not await _has_default_sa(core):
                return "the default ServiceAccount"
            if len(nodes) != KWOK_NODE_COUNT + 1 or pending:
                return f"nodes Ready: {pending or 'the process node'}"
            return None

        await _until(missing, within, "nodes not ready")


async def _until(missing: Callable[[], Awaitable[str | None]], within: float, what: str) -> None:
    """Poll `missing()` (None once nothing is) every 0.2 s; exit naming what is still missing
    after `within` seconds."""
    deadline = time.monotonic() + within
    while (left := await missing()) is not None:
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} in {within:.0f}s: still missing {left}")
        await asyncio.sleep(0.2)


def _schedulable(node: client.V1Node) -> bool:
    ready = any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
    not_ready_taint = any(t.key.startswith("node.kubernetes.io/") for t in node.spec.taints or [])
    return ready and not not_ready_taint


async def _has_default_sa(core: client.CoreV1Api, namespace: str = "default") -> bool:
    try:
        await core.read_namespaced_service_account("default", namespace)
    except ApiException:
        return False
    return True


def _start_service_proxy(layout: Layout) -> None:
    say("starting the service proxy")
    daemons.start(
        layout,
        PROXY,
        [sys.executable, "-m", "testbed.service_proxy", f"--kubeconfig={layout.kubeconfig}"],
        env={"PYTHONPATH": str(HACK_DIR), "DYNAMO_TESTBED_DIR": str(layout.root)},
    )


def _start_volume_provisioner(layout: Layout) -> None:
    say("starting the volume provisioner (StorageClass testbed-local, the default)")
    daemons.start(
        layout,
        VOLUMES,
        [sys.executable, "-m", "testbed.volume_provisioner"],
        env={"PYTHONPATH": str(HACK_DIR), "DYNAMO_TESTBED_DIR": str(layout.root)},
    )


def up(layout: Layout, ports: Ports, with_kubelet_node: bool) -> None:
    started = time.monotonic()
    if daemons.pid_of(layout, AGENT) and daemons.pid_of(layout, "kube-apiserver"):
        if not daemons.pid_of(layout, PROXY):  # a test bed started before it had one
            _start_service_proxy(layout)
        if not daemons.pid_of(layout, VOLUMES):
            _start_volume_provisioner(layout)
        if with_kubelet_node and not daemons.pid_of(layout, kubelet_node.SUPERVISOR):
            _start_kubelet_node(layout, ports)
        say("already running")
        print_env(layout)
        return
    bin_dir = resolve_bin_dir()
    kubelet_api_binary = _built("build-kubelet-api")
    layout.ensure()
    layout.bin_dir_file.write_text(str(bin_dir))
    ensure_pki(layout.pki)
    write_admin_kubeconfig(layout.pki, server_url(ports), layout.kubeconfig)
    network.ensure_nftables()
    network.setup_host()
    unshared = cpu_share.available()
    if unshared:
        say(f"no CPU share for the control plane ({unshared}): pods may slow the API server")
    stages = kwok_stages(bin_dir, _gomodcache())
    for component in components(layout, ports, bin_dir, stages):
        _start(layout, component)
    _start_service_proxy(layout)
    _start_volume_provisioner(layout)
    _start(layout, kubelet_api(layout, ports, kubelet_api_binary))
    say("starting the process node")
    daemons.start(
        layout,
        AGENT,
        [sys.executable, "-m", "testbed.process_node", f"--node-name={PROCESS_NODE_NAME}"],
        env={"PYTHONPATH": str(HACK_DIR), "DYNAMO_TESTBED_DIR": str(layout.root)},
    )
    say(f"creating {KWOK_NODE_COUNT} fake GPU nodes and waiting for every node to be Ready")
    asyncio.run(_create_nodes_and_wait(layout, 90))
    if not daemons.pid_of(layout, PROXY):
        raise SystemExit(f"the service proxy exited; see {layout.logs / PROXY}.log")
    if with_kubelet_node:
        _start_kubelet_node(layout, ports)
    say(f"ready in {time.monotonic() - started:.1f}s (Kubernetes {read_versions()['K8S_VERSION']})")
    print_env(layout)


def _start_kubelet_node(layout: Layout, ports: Ports) -> None:
    bin_dir = _built("build-kubelet-node")
    say(f"starting {kubelet_node.NODE_NAME}: the real kubelet, containerd and runc")
    kubelet_node.start(layout, ports, bin_dir)
    paths = kubelet_node.NodePaths(layout)
    if not daemons.wait_for(paths.socket.exists, 30, 0.2):
        raise SystemExit(f"containerd did not start; see {layout.logs / 'containerd.log'}")
    kubelet_node.import_sandbox_image(paths, bin_dir)
    asyncio.run(_kubelet_node_ready(layout, 120))


async def _kubelet_node_ready(layout: Layout, within: float) -> None:
    """The API server may reach the node's kubelet (logs, exec) as kubeadm lets it, and the
    node is Ready with its GPUs advertised."""
    await config.load_kube_config(config_file=str(layout.kubeconfig))
    async with client.ApiClient() as api:
        binding: Any = {
            "metadata": {"name": "testbed:apiserver-kubelet-client"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "system:kubelet-api-admin",
            },
            "subjects": [
                {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "User",
                    "name": KUBELET_CLIENT_USER,
                }
            ],
        }
        try:
            await client.RbacAuthorizationV1Api(api).create_cluster_role_binding(binding)
        except ApiException as exc:
            if exc.status != 409:
                raise
        core = client.CoreV1Api(api)

        async def missing() -> str | None:
            try:
                node = await core.read_node(kubelet_node.NODE_NAME)
            except ApiException:
                return "its Node"
            if not _schedulable(node):
                return "its Ready condition"
            if node.status.allocatable.get("nvidia.com/gpu") != str(GPUS_PER_NODE):
                return f"{GPUS_PER_NODE} nvidia.com/gpu (the device plugin)"
            return None

        await _until(
            missing, within, f"{kubelet_node.NODE_NAME} not Ready (see {layout.logs}/kubelet.log)"
        )


def restart_apiserver(layout: Layout, ports: Ports, down_seconds: float) -> None:
    """Stop the kube-apiserver, leave it stopped for `down_seconds`, and start it again with
    the same flags (the fault suite's "API server restarted"). etcd and every other component
    keep running, and reconnect as they would to a restarted control plane."""
    if not daemons.pid_of(layout, "kube-apiserver"):
        raise SystemExit("the kube-apiserver is not running; start the test bed with `up`")
    bin_dir = Path(layout.bin_dir_file.read_text().strip())
    stages = kwok_stages(bin_dir, _gomodcache())
    apiserver = next(
        c for c in components(layout, ports, bin_dir, stages) if c.name == "kube-apiserver"
    )
    say("stopping kube-apiserver")
    daemons.stop(layout, "kube-apiserver")
    time.sleep(down_seconds)
    _start(layout, apiserver)
    started = time.monotonic()
    say("waiting for the controllers to watch again")
    asyncio.run(_wait_controllers_back(layout, CONTROLLERS_BACK_TIMEOUT))
    say(f"the controllers act again, {time.monotonic() - started:.1f}s after the restart")


async def _wait_controllers_back(layout: Layout, within: float) -> None:
    """Until the components that watch the API server see new objects again: a new
    namespace gets its `default` ServiceAccount (the controller-manager's ServiceAccount
    controller), and a one-pod Deployment in it becomes available on a fake node (its
    Deployment and ReplicaSet controllers, the scheduler, KWOK). A reflector relists only
    after its backoff, so an answering API server alone does not say that they are back: a
    roll started meanwhile stalls for up to a minute with nothing wrong in what it tests."""
    await config.load_kube_config(config_file=str(layout.kubeconfig))
    async with client.ApiClient() as api:
        core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
        namespace = f"testbed-probe-{os.getpid()}-{int(time.time())}"
        body: Any = {"metadata": {"name": namespace}}
        await core.create_namespace(body)
        try:
            await _until(
                lambda: _missing_sa(core, namespace), within, "controllers not back after a restart"
            )
            await apps.create_namespaced_deployment(namespace, _probe_deployment())
            await _until(
                lambda: _unavailable(apps, namespace),
                within,
                "controllers not back after a restart",
            )
        finally:
            await core.delete_namespace(namespace)


def _probe_deployment() -> Any:
    labels = {"app": "testbed-probe"}
    return {
        "metadata": {"name": "probe"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": {"type": "kwok"},  # KWOK runs nothing: it only says Ready
                    "containers": [{"name": "probe", "image": "registry.invalid/probe"}],
                },
            },
        },
    }


async def _missing_sa(core: client.CoreV1Api, namespace: str) -> str | None:
    if await _has_default_sa(core, namespace):
        return None
    return "a new namespace's default ServiceAccount"


async def _unavailable(apps: client.AppsV1Api, namespace: str) -> str | None:
    status = (await apps.read_namespaced_deployment("probe", namespace)).status
    return None if (status.available_replicas or 0) >= 1 else "a one-pod Deployment available"


def down(layout: Layout) -> None:
    if daemons.pid_of(layout, kubelet_node.SUPERVISOR):
        say(f"stopping {kubelet_node.NODE_NAME} (its pods, the kubelet, containerd)")
    kubelet_node.stop(layout)
    # Our components in order, then anything else started beside them (e.g. the demo's S3).
    extra = sorted(p.stem for p in layout.pids.glob("*.pid") if p.stem not in STOP_ORDER)
    for name in [*extra, *STOP_ORDER]:
        if daemons.pid_of(layout, name):
            say(f"stopping {name}")
        daemons.stop(layout, name)
    network.teardown_host()
    cpu_share.remove()
    # A fresh store next time: each `up` starts from an empty cluster.
    shutil.rmtree(layout.etcd_data, ignore_errors=True)
    shutil.rmtree(layout.pods, ignore_errors=True)
    shutil.rmtree(layout.root / "volumes", ignore_errors=True)
    left = network.leftovers() + kubelet_node.leftovers(layout)
    if left:
        raise SystemExit(f"left behind: {left}")
    say("stopped; nothing left behind")


def status(layout: Layout) -> int:
    running = 0
    for name in reversed(STOP_ORDER):
        pid = daemons.pid_of(layout, name)
        running += bool(pid)
        print(f"{name:26} {'running (pid ' + str(pid) + ')' if pid else 'stopped'}")
    node_pid = daemons.pid_of(layout, kubelet_node.SUPERVISOR)
    if node_pid:
        print(f"{kubelet_node.SUPERVISOR:26} running (pid {node_pid})")
    for item in network.leftovers():
        print(f"network: {item}")
    for item in kubelet_node.leftovers(layout):
        print(f"{kubelet_node.SUPERVISOR}: {item}")
    return 0 if running == len(STOP_ORDER) else 1


def print_env(layout: Layout) -> None:
    print(f"export KUBECONFIG={layout.kubeconfig}")
    if layout.bin_dir_file.exists():
        print(f"export PATH={layout.bin_dir_file.read_text().strip()}:$PATH")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="hack/cluster",
        description="A real Kubernetes control plane on this machine, with 4 fake GPU nodes "
        "(KWOK) and a process node that runs pods as local processes.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("up", help="start the test bed (builds binaries on first use)")
    start.add_argument(
        "--no-kubelet-node",
        dest="kubelet_node",
        action="store_false",
        help=f"without {kubelet_node.NODE_NAME} (the real kubelet, containerd and runc)",
    )
    sub.add_parser("down", help="stop every process the test bed started and remove its network")
    sub.add_parser("status", help="show what runs (exit 1 unless everything does)")
    sub.add_parser("env", help="print `export KUBECONFIG=...` (and PATH for kubectl/helm)")
    restart = sub.add_parser(
        "restart-apiserver", help="stop the kube-apiserver, wait, and start it again"
    )
    restart.add_argument(
        "--down-seconds", type=float, default=5.0, help="how long it stays stopped (5)"
    )
    load = sub.add_parser(
        "import-images",
        help=f"import images from docker into {kubelet_node.NODE_NAME}'s containerd"
        " (those it lacks; a no-op when the node is not running)",
    )
    load.add_argument("images", nargs="+", metavar="IMAGE", help="name:tag, as docker has it")
    load.add_argument("--docker", default="docker", help="the docker CLI to save them with")
    args = parser.parse_args(argv)
    layout, ports = Layout.from_env(), Ports()
    if os.geteuid() != 0 and args.command in ("up", "down", "restart-apiserver", "import-images"):
        raise SystemExit("hack/cluster needs root (it creates network namespaces and routes)")
    if args.command == "up":
        up(layout, ports, args.kubelet_node)
    elif args.command == "down":
        down(layout)
    elif args.command == "restart-apiserver":
        restart_apiserver(layout, ports, args.down_seconds)
    elif args.command == "import-images":
        if not daemons.pid_of(layout, kubelet_node.SUPERVISOR):
            say(f"{kubelet_node.NODE_NAME} is not running: nothing to import")
            return
        for ref in kubelet_node.import_images(layout, args.images, args.docker):
            say(f"imported {ref} into {kubelet_node.NODE_NAME}")
    elif args.command == "status":
        sys.exit(status(layout))
    else:
        print_env(layout)


if __name__ == "__main__":
    main()
