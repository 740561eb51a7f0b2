"""The control-plane components and how to start them: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and KWOK, plus the process node's kubelet API, each a
daemon with a readiness check."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .layout import GATEWAY_IP, SERVICE_CIDR, Layout, Ports, read_versions, server_url
from .pki import KUBELET_CLIENT_USER

# The KWOK stages we run: nodes become Ready and heartbeat through their Lease; pods become
# Running/Ready at once, Job pods complete, deleted pods are finalized.
KWOK_STAGE_FILES = [
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-complete.yaml",
    "pod/fast/pod-delete.yaml",
]


@dataclass(frozen=True)
class Component:
    name: str
    argv: list[str]
    ready: Callable[[], bool]


def _get_ok(url: str, context: ssl.SSLContext | None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _admin_tls(layout: Layout) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(layout.pki / "ca.crt"))
    ctx.load_cert_chain(str(layout.pki / "admin.crt"), str(layout.pki / "admin.key"))
    return ctx


def _self_signed_tls() -> ssl.SSLContext:
    # The controller manager and scheduler serve /healthz with certificates they generate
    # themselves at start; only liveness is read from them.
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def kwok_stages(bin_dir: Path, gomodcache: Path) -> Path:
    """The KWOK stage file, assembled once from the kwok module's own stage definitions."""
    target = bin_dir / "kwok-stages.yaml"
    if target.exists():
        return target
    version = read_versions()["KWOK_VERSION"]
    stage_dir = gomodcache / f"sigs.k8s.io/kwok@{version}/kustomize/stage"
    if not stage_dir.is_dir():
        raise SystemExit(
            f"KWOK stages not found in {stage_dir}; put kwok-stages.yaml next to the kwok binary"
        )
    docs = [(stage_dir / rel).read_text().strip() for rel in KWOK_STAGE_FILES]
    target.write_text("\n---\n".join(docs) + "\n")
    return target


def components(layout: Layout, ports: Ports, bin_dir: Path, stages: Path) -> list[Component]:
    """The components in start order."""
    pki, kubeconfig = layout.pki, str(layout.kubeconfig)
    admin = _admin_tls(layout)
    insecure = _self_signed_tls()
    common_auth = [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
        "--bind-address=127.0.0.1",
        "--leader-elect=false",
    ]
    return [
        Component(
            "etcd",
            [
                str(bin_dir / "etcd"),
                "--name=testbed",
                f"--data-dir={layout.etcd_data}",
                f"--listen-client-urls=http://127.0.0.1:{ports.etcd_client}",
                f"--advertise-client-urls=http://127.0.0.1:{ports.etcd_client}",
                f"--listen-peer-urls=http://127.0.0.1:{ports.etcd_peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{ports.etcd_peer}",
                f"--initial-cluster=testbed=http://127.0.0.1:{ports.etcd_peer}",
                "--auto-compaction-retention=1",
                "--quota-backend-bytes=4294967296",
                # Test data: losing it on a crash is fine, and fsync dominates write latency.
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
            lambda: _get_ok(f"http://127.0.0.1:{ports.etcd_client}/health", None),
        ),
        Component(
            "kube-apiserver",
            [
                str(bin_dir / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
                # The gateway address is on this host; pods reach the API server there.
                f"--bind-address={GATEWAY_IP}",
                f"--advertise-address={GATEWAY_IP}",
                f"--secure-port={ports.apiserver}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--cert-dir={pki}",
                "--authorization-mode=Node,RBAC",
                # On top of the default admission plugins, as a kubeadm cluster has.
                "--enable-admission-plugins=NodeRestriction",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--allow-privileged=true",
                # Towards the process node's kubelet API (logs, exec, attach, port-forward):
                # at its InternalIP, a serving certificate from the test bed's CA, and our own
                # kubelet client certificate.
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                f"--kubelet-certificate-authority={pki / 'ca.crt'}",
                f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
                "--profiling=false",
                "--v=1",
            ],
            lambda: _get_ok(f"{server_url(ports)}/readyz", admin),
        ),
        Component(
            "kube-controller-manager",
            [
                str(bin_dir / "kube-controller-manager"),
                *common_auth,
                f"--secure-port={ports.controller_manager}",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                f"--cluster-signing-cert-file={pki / 'ca.crt'}",
                f"--cluster-signing-key-file={pki / 'ca.key'}",
                "--controllers=*",
                "--node-monitor-period=5s",
                "--node-monitor-grace-period=40s",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--concurrent-deployment-syncs=10",
                "--concurrent-replicaset-syncs=10",
            ],
            lambda: _get_ok(f"https://127.0.0.1:{ports.controller_manager}/healthz", insecure),
        ),
        Component(
            "kube-scheduler",
            [str(bin_dir / "kube-scheduler"), *common_auth, f"--secure-port={ports.scheduler}"],
            lambda: _get_ok(f"https://127.0.0.1:{ports.scheduler}/healthz", insecure),
        ),
        Component(
            "kwok",
            [
                str(bin_dir / "kwok"),
                f"--kubeconfig={kubeconfig}",
                f"--config={stages}",
                "--manage-all-nodes=false",
                "--manage-nodes-with-label-selector=type=kwok",
                "--node-lease-duration-seconds=40",
                "--cidr=198.18.255.0/24",
                f"--server-address=127.0.0.1:{ports.kwok}",
            ],
            lambda: _get_ok(f"http://127.0.0.1:{ports.kwok}/healthz", None),
        ),
    ]


def kubelet_api(layout: Layout, ports: Ports, binary: Path) -> Component:
    """The process node's kubelet API (hack/testbed/kubelet), ready once it answers the API
    server's kubelet client certificate."""
    pki = layout.pki
    as_apiserver = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    as_apiserver.load_cert_chain(
        str(pki / "apiserver-kubelet-client.crt"), str(pki / "apiserver-kubelet-client.key")
    )
    return Component(
        "kubelet-api",
        [
            str(binary),
            f"--listen={GATEWAY_IP}:{ports.kubelet}",
            f"--tls-cert-file={pki / 'kubelet.crt'}",
            f"--tls-private-key-file={pki / 'kubelet.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--allowed-user={KUBELET_CLIENT_USER}",
            f"--pods-dir={layout.pods}",
        ],
        lambda: _get_ok(f"https://{GATEWAY_IP}:{ports.kubelet}/healthz", as_apiserver),
    )
