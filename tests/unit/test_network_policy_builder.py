"""The worker pods' NetworkPolicy (builders.desired_network_policy): who may reach which port.

The objects themselves are checked by the real API server in
tests/cluster/test_worker_network_policy.py; the golden files show the full rendering.
"""

from __future__ import annotations

from typing import Any

import pytest

from dynamo_operator.api import DynamoWorker
from dynamo_operator.reconcile.dynamoworker.builders import (
    desired_children,
    desired_network_policy,
)
from dynamo_operator.reconcile.dynamoworker.settings import ReconcileSettings
from support.api_cases import dynamo_worker

pytestmark = pytest.mark.unit

SETTINGS = ReconcileSettings(worker_image="w", frontend_image="f", operator_namespace="ops")
NS = "kubernetes.io/metadata.name"


def stored(spec: dict[str, Any]) -> DynamoWorker:
    manifest = dynamo_worker("llm", spec=spec)
    manifest["metadata"] |= {"namespace": "team", "uid": "u-1"}
    return DynamoWorker.model_validate(manifest)


def test_system_port_admits_the_operator_and_named_namespaces_only() -> None:
    dw = stored({"networkPolicy": {"systemPortNamespaces": ["monitoring"]}})
    policy = desired_network_policy(dw, SETTINGS)
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {"dynamo.dev/worker": "llm"}}
    # Only ingress is limited: downloads (egress) stay open.
    assert spec["policyTypes"] == ["Ingress"]
    [system] = spec["ingress"]  # no frontend, no client namespaces: nothing else gets in
    assert system["ports"] == [{"port": "system", "protocol": "TCP"}]
    assert system["from"] == [
        {
            "namespaceSelector": {"matchLabels": {NS: "ops"}},
            "podSelector": {"matchLabels": {"dynamo.dev/operator": "true"}},
        },
        {"namespaceSelector": {"matchLabels": {NS: "monitoring"}}},
    ]
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "u-1"


def test_frontend_and_client_namespaces_reach_every_port() -> None:
    dw = stored({"frontend": {}, "networkPolicy": {"clientNamespaces": ["gateway"]}})
    _, clients = desired_network_policy(dw, SETTINGS)["spec"]["ingress"]
    # The TCP request plane and the event plane listen on advertised ephemeral ports.
    assert "ports" not in clients
    assert clients["from"] == [
        {
            "namespaceSelector": {"matchLabels": {NS: "team"}},
            "podSelector": {"matchLabels": {"dynamo.dev/frontend": "llm"}},
        },
        {"namespaceSelector": {"matchLabels": {NS: "gateway"}}},
    ]
    for rule in desired_network_policy(dw, SETTINGS)["spec"]["ingress"]:
        assert rule["from"], "a rule without peers would admit every pod"


def test_operator_outside_a_known_namespace_is_matched_by_its_label() -> None:
    policy = desired_network_policy(stored({}), ReconcileSettings(worker_image="w"))
    [system] = policy["spec"]["ingress"]
    assert system["from"][0] == {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"dynamo.dev/operator": "true"}},
    }


def test_on_by_default_and_off_on_request() -> None:
    kinds = [c["kind"] for c in desired_children(stored({}), SETTINGS)]
    assert kinds.count("NetworkPolicy") == 1
    off = stored({"networkPolicy": {"enabled": False}})
    assert "NetworkPolicy" not in [c["kind"] for c in desired_children(off, SETTINGS)]


def test_namespace_names_are_checked() -> None:
    with pytest.raises(ValueError, match=r"system_?[pP]ort_?[nN]amespaces"):
        stored({"networkPolicy": {"systemPortNamespaces": ["Not_A_Namespace"]}})
