"""`hack/cluster up | down | status | env`: the test bed's command line."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from . import daemons, network
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
from .pki import ensure_pki, write_admin_kubeconfig

AGENT = "process-node"
KUBELET_API = "kubelet-api"
PROXY = "service-proxy"
# Stop order: the process node first (it stops its pods, which may use Services until they
# exit), its kubelet API, the service proxy, then the control plane top-down.
STOP_ORDER = [
    AGENT,
    KUBELET_API,
    PROXY,
    "kwok",
    "kube-scheduler",
    "kube-controller-manager",
    "kube-apiserver",
    "etcd",
]
READY_TIMEOUT = {"etcd": 30, "kube-apiserver": 120}


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
        deadline = time.monotonic() + within
        while True:
            nodes = (await core.list_node()).items
            pending = [n.metadata.name for n in nodes if not _schedulable(n)]
            have_sa = await _has_default_sa(core)
            if len(nodes) == KWOK_NODE_COUNT + 1 and not pending and have_sa:
                return
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"nodes not ready in {within:.0f}s: {pending or 'process node missing'}"
                    f"{'' if have_sa else '; default ServiceAccount missing'}"
                )
            await asyncio.sleep(0.5)


def _schedulable(node: client.V1Node) -> bool:
    ready = any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
    not_ready_taint = any(t.key.startswith("node.kubernetes.io/") for t in node.spec.taints or [])
    return ready and not not_ready_taint


async def _has_default_sa(core: client.CoreV1Api) -> bool:
    try:
        await core.read_namespaced_service_account("default", "default")
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


def up(layout: Layout, ports: Ports) -> None:
    started = time.monotonic()
    if daemons.pid_of(layout, AGENT) and daemons.pid_of(layout, "kube-apiserver"):
        if not daemons.pid_of(layout, PROXY):  # a test bed started before it had one
            _start_service_proxy(layout)
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
    stages = kwok_stages(bin_dir, _gomodcache())
    for component in components(layout, ports, bin_dir, stages):
        _start(layout, component)
    _start_service_proxy(layout)
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
    say(f"ready in {time.monotonic() - started:.1f}s (Kubernetes {read_versions()['K8S_VERSION']})")
    print_env(layout)


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


def down(layout: Layout) -> None:
    # Our components in order, then anything else started beside them (e.g. the demo's S3).
    extra = sorted(p.stem for p in layout.pids.glob("*.pid") if p.stem not in STOP_ORDER)
    for name in [*extra, *STOP_ORDER]:
        if daemons.pid_of(layout, name):
            say(f"stopping {name}")
        daemons.stop(layout, name)
    network.teardown_host()
    # A fresh store next time: each `up` starts from an empty cluster.
    shutil.rmtree(layout.etcd_data, ignore_errors=True)
    shutil.rmtree(layout.pods, ignore_errors=True)
    left = network.leftovers()
    if left:
        raise SystemExit(f"left behind: {left}")
    say("stopped; nothing left behind")


def status(layout: Layout) -> int:
    running = 0
    for name in reversed(STOP_ORDER):
        pid = daemons.pid_of(layout, name)
        running += bool(pid)
        print(f"{name:26} {'running (pid ' + str(pid) + ')' if pid else 'stopped'}")
    for item in network.leftovers():
        print(f"network: {item}")
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
    sub.add_parser("up", help="start the test bed (builds binaries on first use)")
    sub.add_parser("down", help="stop every process the test bed started and remove its network")
    sub.add_parser("status", help="show what runs (exit 1 unless everything does)")
    sub.add_parser("env", help="print `export KUBECONFIG=...` (and PATH for kubectl/helm)")
    restart = sub.add_parser(
        "restart-apiserver", help="stop the kube-apiserver, wait, and start it again"
    )
    restart.add_argument(
        "--down-seconds", type=float, default=5.0, help="how long it stays stopped (5)"
    )
    args = parser.parse_args(argv)
    layout, ports = Layout.from_env(), Ports()
    if os.geteuid() != 0 and args.command in ("up", "down", "restart-apiserver"):
        raise SystemExit("hack/cluster needs root (it creates network namespaces and routes)")
    if args.command == "up":
        up(layout, ports)
    elif args.command == "down":
        down(layout)
    elif args.command == "restart-apiserver":
        restart_apiserver(layout, ports, args.down_seconds)
    elif args.command == "status":
        sys.exit(status(layout))
    else:
        print_env(layout)


if __name__ == "__main__":
    main()
