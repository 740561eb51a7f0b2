"""The test bed's pod network on this machine: a gateway address on the host, an unreachable
route for the guarded range, and one network namespace + veth pair per process-node pod (what
a CNI plugin would do), plus the Service addresses the service proxy puts on `lo` and the
nftables table that enforces NetworkPolicy (hack/testbed/policy_agent.py). Everything it
creates carries a `dtb` prefix or lies in the guarded range, so `down` can remove exactly
that and nothing else."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import shutil
import subprocess

from .layout import (
    GATEWAY_IP,
    GUARDED_RANGE,
    NETNS_PREFIX,
    NFT_TABLE,
    SERVICE_CIDR,
    VETH_PREFIX,
)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _sysctl(key: str, value: str) -> None:
    path = "/proc/sys/" + key.replace(".", "/")
    with open(path, "w") as f:
        f.write(value)


def _lo_addresses() -> list[str]:
    """The IPv4 addresses on `lo`, without their prefix length."""
    out = _ip("-4", "-o", "addr", "show", "dev", "lo", check=False).stdout
    # Each line reads `1: lo    inet 198.19.0.10/32 scope global lo ...`.
    return [line.split()[3].split("/")[0] for line in out.splitlines() if " inet " in line]


def ensure_nftables() -> None:
    """Install `nft` (Debian's nftables) when it is missing, as on a fresh CI machine:
    NetworkPolicy enforcement needs it."""
    if shutil.which("nft"):
        return
    if not shutil.which("apt-get"):
        raise SystemExit("NetworkPolicy enforcement needs `nft`: install the nftables package")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "nftables"]
    if subprocess.run(install, env=env, capture_output=True, check=False).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=False)
        result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise SystemExit(f"`apt-get install nftables` failed:\n{result.stderr[-2000:]}")


def nft_tables() -> list[str]:
    """The test bed's nftables tables that exist now (`ip dtb_netpol` while policies apply)."""
    if not shutil.which("nft"):
        return []
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=False)
    tables = [line.split(maxsplit=1)[1] for line in out.stdout.splitlines() if line.strip()]
    return [t for t in tables if t.split()[-1] == NFT_TABLE]


def delete_nft_tables() -> None:
    for table in nft_tables():
        subprocess.run(["nft", "delete", "table", *table.split()], capture_output=True, check=False)


def setup_host() -> None:
    """Give the host its gateway address and hold the whole range as unreachable."""
    if GATEWAY_IP not in _lo_addresses():
        _ip("addr", "add", f"{GATEWAY_IP}/32", "dev", "lo")
    hold_range()


def hold_range() -> None:
    """The unreachable route over the whole range (kept by `down`, see `teardown_host`)."""
    if "unreachable " + str(GUARDED_RANGE) not in _ip("route", "show").stdout:
        _ip("route", "add", "unreachable", str(GUARDED_RANGE))


def service_addresses() -> list[str]:
    """The Service cluster IPs the service proxy holds on `lo` now."""
    service_range = ipaddress.ip_network(SERVICE_CIDR)
    return [a for a in _lo_addresses() if ipaddress.ip_address(a) in service_range]


def add_service_address(cluster_ip: str) -> None:
    """Make a Service's cluster IP a local address of the host, so that connections from the
    host and from pods (routed here through their veth) are delivered to the proxy's
    listeners: the `local` routing table is consulted before `main`, where the guarded
    range is unreachable."""
    if ipaddress.ip_address(cluster_ip) not in ipaddress.ip_network(SERVICE_CIDR):
        raise ValueError(f"cluster IP {cluster_ip} is outside the service CIDR {SERVICE_CIDR}")
    if cluster_ip not in _lo_addresses():
        _ip("addr", "add", f"{cluster_ip}/32", "dev", "lo")


def delete_service_address(cluster_ip: str) -> None:
    """Remove a Service's cluster IP from `lo` (a no-op when it is not there)."""
    _ip("addr", "del", f"{cluster_ip}/32", "dev", "lo", check=False)


def netns_name(pod_uid: str) -> str:
    return NETNS_PREFIX + pod_uid[:8]


def veth_name(pod_uid: str) -> str:
    # Interface names are limited to 15 bytes; a digest keeps them unique and short.
    return VETH_PREFIX + hashlib.sha1(pod_uid.encode()).hexdigest()[:10]


def delete_link(name: str) -> None:
    _ip("link", "del", name, check=False)


def create_pod_network(pod_uid: str, pod_ip: str) -> str:
    """Create the pod's namespace with `pod_ip` on its eth0 and a host route to it.

    Returns the namespace name. Idempotent: an existing namespace is recreated.
    """
    ns = netns_name(pod_uid)
    delete_pod_network(pod_uid, pod_ip)
    _ip("netns", "add", ns)
    wire_pod(ns, veth_name(pod_uid), pod_ip)
    return ns


def wire_pod(ns: str, veth: str, pod_ip: str) -> None:
    """Join the network namespace `ns` (a name under /var/run/netns) to the host: a veth
    pair, `veth` on the host and eth0 in `ns` holding `pod_ip`, and the routes both ways.
    The process node and the kubelet node's CNI plugin (`testbed.cni_veth`) both use it."""
    _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
    _ip("link", "set", veth, "up")
    _ip("-n", ns, "link", "set", "lo", "up")
    _ip("-n", ns, "link", "set", "eth0", "up")
    _ip("-n", ns, "addr", "add", f"{pod_ip}/32", "dev", "eth0")
    _ip("-n", ns, "route", "add", GATEWAY_IP, "dev", "eth0")
    # No default route: a pod reaches the guarded range (other pods, the API server, test
    # services) and nothing else, so nothing it sends can leave the machine.
    _ip("-n", ns, "route", "add", str(GUARDED_RANGE), "via", GATEWAY_IP, "dev", "eth0")
    _ip("route", "replace", f"{pod_ip}/32", "dev", veth, "src", GATEWAY_IP)
    # Forward what arrives from this pod (to another pod's /32 route) without turning on
    # forwarding for the machine's other interfaces.
    _sysctl(f"net.ipv4.conf.{veth}.forwarding", "1")


def delete_pod_network(pod_uid: str, pod_ip: str | None) -> None:
    """Remove the pod's namespace, veth and route (whatever of them exists)."""
    if pod_ip:
        _ip("route", "del", f"{pod_ip}/32", check=False)
    delete_link(veth_name(pod_uid))
    _ip("netns", "del", netns_name(pod_uid), check=False)


def namespaces() -> list[str]:
    """Network namespaces of the test bed that exist now."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(NETNS_PREFIX)]


GUARD_ROUTE = f"unreachable {GUARDED_RANGE}"


def leftovers() -> list[str]:
    """Everything of the test bed's network that exists now (empty after a clean `down`),
    except the guard route: `down` keeps it on purpose (`teardown_host`)."""
    found = [f"netns {ns}" for ns in namespaces()]
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(VETH_PREFIX):
            found.append(f"link {name}")
    for line in _ip("route", "show", check=False).stdout.splitlines():
        dest = line.split()[1] if line.startswith("unreachable") else line.split()[0]
        try:
            net = ipaddress.ip_network(dest, strict=False)
        except ValueError:
            continue
        guard = line.split()[:2] == GUARD_ROUTE.split()
        if net.version == 4 and net.subnet_of(GUARDED_RANGE) and not guard:  # type: ignore[arg-type]
            found.append(f"route {line.strip()}")
    lo = _lo_addresses()
    if GATEWAY_IP in lo:
        found.append(f"address {GATEWAY_IP} on lo")
    found.extend(f"address {ip} on lo" for ip in service_addresses())
    found.extend(f"nftables table {table}" for table in nft_tables())
    return found


def teardown_host() -> None:
    """Remove every namespace, veth, route, address and nftables table the test bed made
    (Service addresses a killed service proxy left on `lo` among them), killing what still
    runs inside its namespaces. The unreachable route over the whole range stays: a client
    still pointed at the bed (a test session that outlived it, a kubeconfig) must fail at
    once on this machine, not reach whatever answers for 198.18.0.0/15 beyond it, as one
    did when a test bed went down under a running session."""
    for ns in namespaces():
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            subprocess.run(["kill", "-KILL", pid], check=False, capture_output=True)
        _ip("netns", "del", ns, check=False)
    for item in leftovers():
        kind, _, rest = item.partition(" ")
        if kind == "link":
            _ip("link", "del", rest, check=False)
        elif kind == "route":
            _ip("route", "del", *rest.split(), check=False)
    for cluster_ip in service_addresses():
        delete_service_address(cluster_ip)
    _ip("addr", "del", f"{GATEWAY_IP}/32", "dev", "lo", check=False)
    delete_nft_tables()
    hold_range()
