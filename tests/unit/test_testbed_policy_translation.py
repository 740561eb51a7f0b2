"""The test bed's NetworkPolicy translation (policies, pods, namespaces -> nftables rules on
the local pods' veths). `nft --check` validates the rendered script where nft is installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from typing import Any

import pytest

from support.cluster import REPO

sys.path.insert(0, str(REPO / "hack"))
from testbed.network_policy import Allow, PodRules, render, translate

pytestmark = pytest.mark.unit


def _pod(
    name: str,
    ip: str | None,
    labels: dict[str, str] | None = None,
    namespace: str = "app",
    ports: list[dict[str, Any]] | None = None,
    phase: str = "Running",
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "labels": labels},
        "spec": {"containers": [{"name": "main", "ports": ports or []}]},
        "status": {"phase": phase, **({"podIP": ip} if ip else {})},
    }


def _ns(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {}}}


def _policy(spec: dict[str, Any], namespace: str = "app", name: str = "p") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace}, "spec": spec}


SERVER = _pod(
    "server", "198.18.1.2", {"app": "server"}, ports=[{"name": "api", "containerPort": 9090}]
)
CLIENT_X = _pod("client-x", "198.18.1.3", {"x": "yes"})
CLIENT_PLAIN = _pod("client", "198.18.1.4", {})
OTHER_NS_X = _pod("far-x", "198.18.1.5", {"x": "yes"}, namespace="other")
PODS = [SERVER, CLIENT_X, CLIENT_PLAIN, OTHER_NS_X]
NAMESPACES = [_ns("app", {"team": "a"}), _ns("other", {"team": "b"})]
LOCAL = {p["metadata"]["uid"]: f"dtb{i}" for i, p in enumerate(PODS)}
ADMIT_X_ON_9090 = _policy(
    {
        "podSelector": {"matchLabels": {"app": "server"}},
        "ingress": [
            {"from": [{"podSelector": {"matchLabels": {"x": "yes"}}}], "ports": [{"port": 9090}]}
        ],
    }
)


def _rules_for(rules: list[PodRules], veth: str) -> PodRules:
    return next(r for r in rules if r.veth == veth)


def test_no_policy_isolates_nothing() -> None:
    assert translate([], PODS, NAMESPACES, LOCAL) == []
    assert "chain" not in render([])


def test_ingress_pod_selector_admits_only_labelled_pods_of_the_namespace_on_the_port() -> None:
    rules = translate([ADMIT_X_ON_9090], PODS, NAMESPACES, LOCAL)
    assert rules == [PodRules("dtb0", (Allow(("198.18.1.3/32",), "tcp", (9090, 9090)),), None)]


def test_namespace_selector_with_and_without_a_pod_selector() -> None:
    both = {
        "namespaceSelector": {"matchLabels": {"team": "b"}},
        "podSelector": {"matchLabels": {"x": "yes"}},
    }
    whole_ns = {
        "namespaceSelector": {
            "matchExpressions": [{"key": "team", "operator": "In", "values": ["a"]}]
        }
    }
    policy = _policy(
        {
            "podSelector": {"matchLabels": {"app": "server"}},
            "ingress": [{"from": [both]}, {"from": [whole_ns]}],
        }
    )
    rules = _rules_for(translate([policy], PODS, NAMESPACES, LOCAL), "dtb0")
    assert rules.ingress == (
        Allow(("198.18.1.5/32",)),
        Allow(("198.18.1.2/31", "198.18.1.4/32")),
    )


def test_ip_block_less_its_exceptions_and_named_ports() -> None:
    policy = _policy(
        {
            "podSelector": {},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"ipBlock": {"cidr": "198.18.1.0/30", "except": ["198.18.1.1/32"]}}],
                    "ports": [{"port": "api"}, {"port": 8000, "endPort": 8010, "protocol": "UDP"}],
                }
            ],
        }
    )
    rules = translate([policy], PODS, NAMESPACES, LOCAL)
    server = _rules_for(rules, "dtb0")
    peers = ("198.18.1.0/32", "198.18.1.2/31")
    assert server.ingress == (Allow(peers, "tcp", (9090, 9090)), Allow(peers, "udp", (8000, 8010)))
    # A pod that declares no port named `api` is admitted only on the numeric range.
    assert _rules_for(rules, "dtb1").ingress == (Allow(peers, "udp", (8000, 8010)),)
    assert _rules_for(rules, "dtb1").egress is None


def test_empty_rule_admits_everything_and_no_rules_deny_everything() -> None:
    allow_all = _policy({"podSelector": {"matchLabels": {"app": "server"}}, "ingress": [{}]})
    deny_all = _policy({"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}, name="deny")
    rules = translate([allow_all, deny_all], PODS, NAMESPACES, LOCAL)
    assert _rules_for(rules, "dtb0") == PodRules("dtb0", (Allow(None),), ())
    assert _rules_for(rules, "dtb2") == PodRules("dtb2", (), ())
    # Pods of another namespace are not selected by these policies.
    assert [r.veth for r in rules] == ["dtb0", "dtb1", "dtb2"]


def test_egress_to_labelled_pods_resolves_named_ports_on_each_destination() -> None:
    policy = _policy(
        {
            "podSelector": {"matchLabels": {"x": "yes"}},
            "policyTypes": ["Egress"],
            "egress": [
                {
                    "to": [{"podSelector": {"matchLabels": {"app": "server"}}}],
                    "ports": [{"port": "api"}],
                }
            ],
        }
    )
    rules = translate([policy], PODS, NAMESPACES, LOCAL)
    assert rules == [PodRules("dtb1", None, (Allow(("198.18.1.2/32",), "tcp", (9090, 9090)),))]


def test_pods_without_an_ip_or_finished_are_no_peers_and_remote_pods_are_not_guarded() -> None:
    pending = _pod("pending", None, {"x": "yes"})
    done = _pod("done", "198.18.1.9", {"x": "yes"}, phase="Succeeded")
    remote_server = _pod("remote", "198.18.16.2", {"app": "server"})
    rules = translate([ADMIT_X_ON_9090], [SERVER, pending, done, remote_server], NAMESPACES, LOCAL)
    assert rules == [PodRules("dtb0", (), None)]  # no peer yet: isolated, nothing admitted


def test_render_jumps_per_veth_and_rejects_the_rest() -> None:
    rules = [
        PodRules("dtb0", (Allow(("198.18.1.3/32",), "tcp", (9090, 9090)),), None),
        PodRules("dtb1", None, (Allow(None, "tcp", (80, 90)), Allow(("198.18.0.0/15",)))),
    ]
    script = render(rules)
    assert script.startswith("table ip dtb_netpol\ndelete table ip dtb_netpol\n")
    assert 'oifname "dtb0" jump ingress_0' in script
    assert 'iifname "dtb1" jump egress_1' in script
    assert (
        script.count('iifname "dtb1" jump egress_1') == 2
    )  # to pods (forward), to the node (input)
    assert "ip saddr { 198.18.1.3/32 } tcp dport 9090 return" in script
    assert "    tcp dport 80-90 return" in script
    assert "ip daddr { 198.18.0.0/15 } return" in script
    assert script.count("reject with tcp reset") == 2
    if shutil.which("nft") and _can_check():
        result = subprocess.run(
            ["nft", "--check", "-f", "-"], input=script, text=True, capture_output=True, check=False
        )
        assert result.returncode == 0, result.stderr


def _can_check() -> bool:
    probe = subprocess.run(
        ["nft", "--check", "-f", "-"],
        input="table ip dtb_probe\n",
        text=True,
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0
