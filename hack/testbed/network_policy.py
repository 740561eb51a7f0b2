"""NetworkPolicy as nftables rules on the process-node pods' veths: a pure translation from
the policies, pods and namespaces (API objects as dicts) to a rule set, and its rendering as
an nft script. hack/testbed/policy_agent.py watches the objects and applies the script.

What it enforces, as a CNI's policy agent does: a pod selected by a policy of type Ingress
(Egress) admits only the connections some rule of such a policy allows; a pod no policy
selects admits everything; replies to allowed connections always pass. Peers are pods (pod
and namespace selectors) and ipBlocks; ports are numbers, ranges (endPort) and names. Two
deliberate differences: the node itself (kubelet probes, the host's clients, the service
proxy, which connects from the node) always reaches its pods, as CNIs let node traffic
through; and a pod's egress to a Service's cluster IP is matched as that address (ipBlock
rules), since the userspace service proxy hides the backend. Refused connections are
rejected at once (TCP reset, ICMP port unreachable), not dropped, so they fail fast.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .layout import NFT_TABLE

Obj = Mapping[str, Any]


@dataclass(frozen=True)
class Allow:
    """Connections one rule lets through: from (ingress) or to (egress) `peers` (CIDRs;
    None: any address), with `protocol` (None: any) to `ports` (an inclusive range; None:
    any port)."""

    peers: tuple[str, ...] | None
    protocol: str | None = None
    ports: tuple[int, int] | None = None


@dataclass(frozen=True)
class PodRules:
    """What one local pod admits; None for a direction no policy isolates."""

    veth: str
    ingress: tuple[Allow, ...] | None
    egress: tuple[Allow, ...] | None


def _matches(selector: Obj | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector (an empty one selects everything)."""
    selector = selector or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _labels(obj: Obj) -> Mapping[str, str]:
    return obj.get("metadata", {}).get("labels") or {}


def _pod_ip(pod: Obj) -> str | None:
    status = pod.get("status") or {}
    if pod.get("spec", {}).get("hostNetwork") or status.get("phase") in ("Succeeded", "Failed"):
        return None
    ip = status.get("podIP")
    return str(ip) if ip else None


def _policy_types(policy: Obj) -> set[str]:
    spec = policy.get("spec") or {}
    if spec.get("policyTypes"):
        return set(spec["policyTypes"])
    return {"Ingress", "Egress"} if spec.get("egress") else {"Ingress"}


class _Cluster:
    """The pods and namespaces peers are picked from."""

    def __init__(self, pods: Iterable[Obj], namespaces: Iterable[Obj]) -> None:
        self.pods = [p for p in pods if _pod_ip(p)]
        self.namespace_labels = {n["metadata"]["name"]: _labels(n) for n in namespaces}

    def peer_pods(self, peer: Obj, policy_namespace: str) -> list[Obj]:
        """The pods a podSelector/namespaceSelector peer picks (without a namespaceSelector:
        in the policy's namespace)."""
        ns_selector = peer.get("namespaceSelector")
        chosen = []
        for pod in self.pods:
            namespace = pod["metadata"]["namespace"]
            if ns_selector is None:
                if namespace != policy_namespace:
                    continue
            elif not _matches(ns_selector, self.namespace_labels.get(namespace, {})):
                continue
            if _matches(peer.get("podSelector"), _labels(pod)):
                chosen.append(pod)
        return chosen


def _ip_block(block: Obj) -> list[str]:
    """The CIDR less its exceptions, as CIDRs."""
    nets = [ipaddress.ip_network(block["cidr"], strict=False)]
    for excluded in block.get("except") or []:
        cut = ipaddress.ip_network(excluded, strict=False)
        nets = [part for net in nets for part in _without(net, cut)]
    return [str(n) for n in nets]


def _without(net: Any, cut: Any) -> list[Any]:
    if not net.overlaps(cut):
        return [net]
    if cut.supernet_of(net):
        return []
    return list(net.address_exclude(cut))


def _collapse(cidrs: Iterable[str]) -> tuple[str, ...]:
    nets = [ipaddress.ip_network(c) for c in cidrs]
    v4 = [n for n in nets if isinstance(n, ipaddress.IPv4Network)]  # the pod network is IPv4
    return tuple(str(n) for n in ipaddress.collapse_addresses(v4))


def _named_port(pod: Obj, name: str, protocol: str) -> int | None:
    for container in pod.get("spec", {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == name and port.get("protocol", "TCP") == protocol:
                return int(port["containerPort"])
    return None


def _port_spans(port: Obj, pod_for_names: Obj | None) -> list[tuple[int, int] | None]:
    """A NetworkPolicyPort's port range, [None] for any port, [] when it matches nothing (a
    name the pod does not declare, or a name with no pod to look it up in)."""
    value = port.get("port")
    if value is None:
        return [None]
    if isinstance(value, str) and not value.isdigit():
        protocol = port.get("protocol", "TCP")
        number = _named_port(pod_for_names, value, protocol) if pod_for_names else None
        return [(number, number)] if number else []
    start = int(value)
    return [(start, int(port.get("endPort") or start))]


def _rule_allows(
    rule: Obj, policy_namespace: str, target: Obj, cluster: _Cluster, egress: bool
) -> list[Allow]:
    peers = rule.get("to" if egress else "from") or []
    # Each peer as (its CIDRs, the pod whose named ports apply): for ingress the target's own,
    # for egress each destination pod's.
    targets: list[tuple[tuple[str, ...] | None, Obj | None]] = []
    if not peers:
        targets.append((None, None if egress else target))
    for peer in peers:
        if "ipBlock" in peer:
            targets.append((_collapse(_ip_block(peer["ipBlock"])), None if egress else target))
            continue
        pods = cluster.peer_pods(peer, policy_namespace)
        if egress:
            targets += [((f"{_pod_ip(p)}/32",), p) for p in pods]
        elif pods:
            targets.append((_collapse(f"{_pod_ip(p)}/32" for p in pods), target))
    allows = []
    for cidrs, names_from in targets:
        for port in rule.get("ports") or [{}]:
            protocol = port.get("protocol", "TCP").lower() if port else None
            allows += [Allow(cidrs, protocol, span) for span in _port_spans(port, names_from)]
    return allows


def translate(
    policies: Iterable[Obj],
    pods: Iterable[Obj],
    namespaces: Iterable[Obj],
    local: Mapping[str, str],
) -> list[PodRules]:
    """The rules for each local pod that some policy isolates. `local` maps the uid of each
    pod whose veth this node guards to that veth's name."""
    pods = list(pods)
    cluster = _Cluster(pods, namespaces)
    policies = list(policies)
    result = []
    for pod in pods:
        veth = local.get(pod["metadata"]["uid"])
        if veth is None:
            continue
        namespace = pod["metadata"]["namespace"]
        directions: dict[str, list[Allow] | None] = {"Ingress": None, "Egress": None}
        for policy in policies:
            if policy["metadata"]["namespace"] != namespace:
                continue
            spec = policy.get("spec") or {}
            if not _matches(spec.get("podSelector"), _labels(pod)):
                continue
            for kind in _policy_types(policy):
                allowed = directions[kind] = directions[kind] or []
                egress = kind == "Egress"
                for rule in spec.get("egress" if egress else "ingress") or []:
                    allowed += _rule_allows(rule, namespace, pod, cluster, egress)
        if directions["Ingress"] is None and directions["Egress"] is None:
            continue
        result.append(PodRules(veth, _unique(directions["Ingress"]), _unique(directions["Egress"])))
    return sorted(result, key=lambda r: r.veth)


def _unique(allows: list[Allow] | None) -> tuple[Allow, ...] | None:
    return None if allows is None else tuple(dict.fromkeys(allows))


def _rule_line(allow: Allow, address: str) -> str:
    parts = []
    if allow.peers is not None:
        parts.append(f"ip {address} {{ {', '.join(allow.peers)} }}")
    if allow.protocol and allow.ports:
        low, high = allow.ports
        parts.append(f"{allow.protocol} dport {low if low == high else f'{low}-{high}'}")
    elif allow.protocol:
        parts.append(f"meta l4proto {allow.protocol}")
    return " ".join([*parts, "return"])


def _chain(name: str, allows: tuple[Allow, ...], address: str) -> list[str]:
    lines = [f"  chain {name} {{"]
    lines += [f"    {_rule_line(a, address)}" for a in allows if a.peers != ()]
    lines += ["    meta l4proto tcp reject with tcp reset", "    reject", "  }"]
    return lines


def render(rules: list[PodRules]) -> str:
    """The nft script that replaces the test bed's table with `rules` (only removes it when
    no pod is isolated)."""
    script = [f"table ip {NFT_TABLE}", f"delete table ip {NFT_TABLE}"]
    if not rules:
        return "\n".join(script) + "\n"
    forward, to_host, chains = [], [], []
    for n, pod in enumerate(rules):
        if pod.egress is not None:
            # Leaving the pod: towards another pod (forward) or the node itself (input).
            forward.append(f'    iifname "{pod.veth}" jump egress_{n}')
            to_host.append(f'    iifname "{pod.veth}" jump egress_{n}')
            chains += _chain(f"egress_{n}", pod.egress, "daddr")
        if pod.ingress is not None:
            forward.append(f'    oifname "{pod.veth}" jump ingress_{n}')
            chains += _chain(f"ingress_{n}", pod.ingress, "saddr")
    established = "    ct state established,related accept"
    script += [
        f"table ip {NFT_TABLE} {{",
        "  chain forward {",
        "    type filter hook forward priority filter; policy accept;",
        established,
        *forward,
        "  }",
        "  chain input {",
        "    type filter hook input priority filter; policy accept;",
        established,
        *to_host,
        "  }",
        *chains,
        "}",
    ]
    return "\n".join(script) + "\n"
