"""The activator's children: only for a worker that may scale to zero, never selected as a
worker pod, joining the worker Service through its own EndpointSlice, least privilege."""

from __future__ import annotations

from typing import Any

import pytest

from dynamo_operator.api.dynamoworker import DynamoWorker
from dynamo_operator.reconcile.dynamoworker import builders
from dynamo_operator.reconcile.dynamoworker.activator import (
    activator_ip,
    desired_activator_children,
)
from dynamo_operator.reconcile.dynamoworker.labels import WORKER_LABEL, selector_labels
from dynamo_operator.reconcile.dynamoworker.settings import ReconcileSettings
from dynamo_operator.reconcile.errors import SpecError

SETTINGS = ReconcileSettings(worker_image="dynamo-worker:test")


def worker(min_replicas: int | None, **spec: Any) -> DynamoWorker:
    body: dict[str, Any] = {
        "metadata": {"name": "llm", "namespace": "ns", "uid": "u1"},
        "spec": {"model": {"name": "m", "source": "s3://b/m"}, **spec},
    }
    if min_replicas is not None:
        body["spec"]["autoscaling"] = {
            "minReplicas": min_replicas,
            "maxReplicas": 4,
            "targetInFlightPerPod": 2,
            "maxHeldRequests": 9,
            "holdTimeoutSeconds": 42,
        }
    return DynamoWorker.model_validate(body)


def by_kind(children: list[dict[str, Any]], name: str) -> dict[str, dict[str, Any]]:
    return {c["kind"]: c for c in children if c["metadata"]["name"] == name}


@pytest.mark.parametrize("min_replicas", [None, 1])
def test_no_activator_unless_the_worker_may_scale_to_zero(min_replicas: int | None) -> None:
    children = builders.desired_children(worker(min_replicas), SETTINGS)
    assert not by_kind(children, "llm-activator")


def test_the_activators_children() -> None:
    children = builders.desired_children(worker(0), SETTINGS)
    mine = by_kind(children, "llm-activator")
    assert set(mine) == {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "EndpointSlice",
        "NetworkPolicy",
        "Deployment",
    }
    pod = mine["Deployment"]["spec"]["template"]
    assert WORKER_LABEL not in pod["metadata"]["labels"]  # no worker selector takes it
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DYN_ACTIVATOR_WORKER"] == "llm"
    assert env["DYN_ACTIVATOR_MAX_HELD"] == "9"
    assert env["DYN_ACTIVATOR_HOLD_TIMEOUT_SECONDS"] == "42"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["image"] == "dynamo-worker:test"

    slice_ = mine["EndpointSlice"]
    assert slice_["metadata"]["labels"]["kubernetes.io/service-name"] == "llm"
    assert "endpoints" not in slice_  # the activator's own field manager owns them
    service = builders.desired_service(worker(0))
    assert {p["name"] for p in slice_["ports"]} == {p["name"] for p in service["spec"]["ports"]}

    rules = mine["Role"]["rules"]
    writes = [r for r in rules if set(r["verbs"]) & {"patch", "create", "delete"}]
    slices = [r for r in writes if r["resources"] == ["endpointslices"]]
    assert slices == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "resourceNames": ["llm-activator"],
            "verbs": ["get", "patch"],
        }
    ]
    assert all(r["resources"] in (["endpointslices"], ["dynamoworkermetadatas"]) for r in rules)


def test_the_workers_admit_the_activator_and_it_admits_the_workers_peers() -> None:
    children = builders.desired_children(worker(0), SETTINGS)
    policies = {c["metadata"]["name"]: c for c in children if c["kind"] == "NetworkPolicy"}
    workers, activator = policies["llm"], policies["llm-activator"]
    peers = [p for rule in workers["spec"]["ingress"] for p in rule["from"]]
    assert {"matchLabels": {"dynamo.dev/activator": "llm"}} in [p.get("podSelector") for p in peers]
    assert workers["spec"]["podSelector"]["matchLabels"] == selector_labels("llm")
    assert activator["spec"]["podSelector"]["matchLabels"] == {"dynamo.dev/activator": "llm"}
    # The activator stands in for the pods: the same peers as theirs, and the workers (the
    # answers of forwarded requests call it home).
    assert activator["spec"]["ingress"][0] == workers["spec"]["ingress"][0]
    activator_peers = [p.get("podSelector") for p in activator["spec"]["ingress"][1]["from"]]
    assert {"matchLabels": selector_labels("llm")} in activator_peers


def test_without_a_worker_image_the_spec_error_names_the_fix() -> None:
    with pytest.raises(SpecError, match="--worker-image"):
        desired_activator_children(worker(0), ReconcileSettings())


def test_activator_ip_reads_the_first_address() -> None:
    assert activator_ip(None) is None
    assert activator_ip({"endpoints": []}) is None
    assert activator_ip({"endpoints": [{"addresses": ["198.18.0.7"]}]}) == "198.18.0.7"
