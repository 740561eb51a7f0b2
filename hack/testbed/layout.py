"""Where the test bed keeps its state, which ports and addresses it uses, and which versions.

Every address the test bed hands out lies in 198.18.0.0/15 (the benchmarking range, neither
private nor public). The host holds an `unreachable` route for the whole range plus one /32
route per live process-node pod, so no packet for a pod or service address leaves the machine.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

HACK_DIR = Path(__file__).resolve().parent.parent
REPO_DIR = HACK_DIR.parent

# The guarded range and how it is carved up.
GUARDED_RANGE = ipaddress.ip_network("198.18.0.0/15")
# The host's own address in the range: the API server and test services listen here, and
# every pod's default route points at it (as a node's gateway would).
GATEWAY_IP = "198.18.0.1"
PROCESS_NODE_POD_CIDR = "198.18.1.0/24"
KWOK_POD_CIDR_TEMPLATE = "198.18.{n}.0/24"  # n = 16 + node index
SERVICE_CIDR = "198.19.0.0/16"
SERVICE_FIRST_IP = "198.19.0.1"

PROCESS_NODE_NAME = "process-node-0"
PROCESS_NODE_TAINT_KEY = "dynamo.dev/process-node"
KWOK_NODE_COUNT = 4
GPUS_PER_NODE = 8

# Names the network code creates, so `down` can find and remove exactly its own things.
NETNS_PREFIX = "dtb-"
VETH_PREFIX = "dtb"
NFT_TABLE = "dtb_netpol"  # NetworkPolicy enforcement (an `ip` family table)


# The process node ignores images, with one exception: a container whose image is in
# `image_venvs()` runs with that venv's interpreter and tools first on PATH, not the project
# venv's. vLLM's worker image runs in vLLM's venv (hack/vllm-venv; vLLM's pins conflict with
# the project venv's), as the real image would run vLLM.
VLLM_WORKER_IMAGE = "dynamo-worker-vllm:testbed"
VLLM_VENV_ENV = "DYNAMO_VLLM_VENV"


def cache_dir() -> Path:
    """The test bed's cache outside the checkout, shared by every checkout on this machine
    (as hack/lib/go-cache.sh names it): builds, venvs, the kubelet node's image store."""
    if os.environ.get("DYNAMO_TESTBED_CACHE"):
        return Path(os.environ["DYNAMO_TESTBED_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dynamo-testbed"


def vllm_venv() -> Path:
    """Where hack/vllm-venv puts vLLM's venv: $DYNAMO_VLLM_VENV, else the cache folder named
    after the vLLM pin (read from the script, its one place)."""
    if os.environ.get(VLLM_VENV_ENV):
        return Path(os.environ[VLLM_VENV_ENV])
    script = (HACK_DIR / "vllm-venv").read_text()
    version = next(
        line.split("=", 1)[1].strip()
        for line in script.splitlines()
        if line.startswith("VLLM_VERSION=")
    )
    return Path.home() / ".cache" / "dynamo-testbed" / f"vllm-venv-{version}"


def image_venvs() -> dict[str, Path]:
    """Image -> the venv its containers run in (read from the environment the process node
    starts with, so `DYNAMO_VLLM_VENV=... hack/cluster up` moves it)."""
    return {VLLM_WORKER_IMAGE: vllm_venv()}


def read_versions() -> dict[str, str]:
    """The pinned component versions from hack/versions.env (the one place they live)."""
    versions: dict[str, str] = {}
    for line in (HACK_DIR / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            versions[key.strip()] = value.strip()
    return versions


@dataclass(frozen=True)
class Ports:
    """Ports of the control plane and the process node's kubelet API. The API server and the
    kubelet API listen on the gateway address (the process node's InternalIP); the rest on
    loopback."""

    etcd_client: int = 12379
    etcd_peer: int = 12380
    apiserver: int = 16443
    controller_manager: int = 20257
    scheduler: int = 20259
    kwok: int = 20247
    kubelet: int = 20250
    kubelet_node: int = 20251  # kubelet-node-0's real kubelet, on its own address
    kubelet_node_healthz: int = 20252


@dataclass(frozen=True)
class Layout:
    """Paths of one test bed's state directory."""

    root: Path

    @classmethod
    def from_env(cls) -> Layout:
        return cls(Path(os.environ.get("DYNAMO_TESTBED_DIR", REPO_DIR / ".testbed")).resolve())

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def pods(self) -> Path:
        """Per-pod directories on the process node (service-account token, volumes, logs)."""
        return self.root / "pods"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "admin.kubeconfig"

    @property
    def bin_dir_file(self) -> Path:
        """Records which binaries the running test bed uses."""
        return self.root / "bin-dir"

    def ensure(self) -> None:
        for path in (self.pki, self.logs, self.pids, self.etcd_data, self.pods):
            path.mkdir(parents=True, exist_ok=True)


def server_url(ports: Ports) -> str:
    return f"https://{GATEWAY_IP}:{ports.apiserver}"
