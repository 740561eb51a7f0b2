"""The apply-or-skip rule: a child is applied unless the live object already holds the stamped
desired manifest (semantic subset, quantities by value, the applied-hash annotation)."""

from __future__ import annotations

import copy
from decimal import Decimal
from typing import Any

import pytest

from dynamo_operator.reconcile.converge import (
    difference,
    manifest_hash,
    needs_apply,
    parse_quantity,
    stamped,
)

pytestmark = pytest.mark.unit

DESIRED: dict[str, Any] = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "llm", "namespace": "ns", "labels": {"a": "1"}},
    "spec": {
        "replicas": 2,
        "template": {
            "spec": {
                "containers": [
                    {
                        "name": "main",
                        "env": [{"name": "X", "value": "1"}],
                        "resources": {"requests": {"cpu": "500m", "memory": 8589934592}},
                    }
                ]
            }
        },
    },
}


def live_copy(manifest: dict[str, Any]) -> dict[str, Any]:
    """What the API server returns: our fields plus its own, quantities normalized."""
    live = copy.deepcopy(manifest)
    live["metadata"] |= {"uid": "u", "resourceVersion": "9", "managedFields": [{}]}
    live["spec"]["progressDeadlineSeconds"] = 600
    container = live["spec"]["template"]["spec"]["containers"][0]
    container["resources"]["requests"] = {"cpu": "0.5", "memory": "8Gi"}
    container["terminationMessagePath"] = "/dev/termination-log"
    live["status"] = {"replicas": 2}
    return live


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("8Gi", Decimal(8 * 2**30)),
        ("500m", Decimal("0.5")),
        ("1", Decimal(1)),
        ("1e3", Decimal(1000)),
        ("1.5k", Decimal(1500)),
        (4, Decimal(4)),
        ("Qwen", None),
        (True, None),
        ("", None),
        ("5e9999999", None),  # past Decimal's range: a hash, not a quantity
        ("7e999999E", None),
    ],
)
def test_parse_quantity(text: object, value: Decimal | None) -> None:
    assert parse_quantity(text) == value


def test_converged_live_object_needs_no_apply() -> None:
    desired = stamped(DESIRED)
    assert not needs_apply(desired, live_copy(desired))


def test_absent_object_is_applied() -> None:
    assert needs_apply(stamped(DESIRED), None)


@pytest.mark.parametrize(
    ("edit", "path"),
    [
        (lambda o: o["spec"].__setitem__("replicas", 5), "spec.replicas"),
        (lambda o: o["metadata"]["labels"].pop("a"), "metadata.labels.a"),
        (
            lambda o: o["spec"]["template"]["spec"]["containers"][0]["env"].append(
                {"name": "Y", "value": "2"}
            ),
            "spec.template.spec.containers[0].env",
        ),
        (
            lambda o: o["spec"]["template"]["spec"]["containers"][0]["resources"][
                "requests"
            ].update(cpu="1"),
            "spec.template.spec.containers[0].resources.requests.cpu",
        ),
        (
            lambda o: o["metadata"]["annotations"].__setitem__("dynamo.dev/applied-hash", "old"),
            "metadata.annotations.dynamo.dev/applied-hash",
        ),
    ],
)
def test_drift_in_owned_fields_is_found(edit: Any, path: str) -> None:
    desired = stamped(DESIRED)
    live = live_copy(desired)
    edit(live)
    assert needs_apply(desired, live)
    assert difference(desired, live) == path


def test_a_field_no_longer_desired_changes_the_hash() -> None:
    old = stamped(DESIRED)
    live = live_copy(old)
    new_desired = copy.deepcopy(DESIRED)
    del new_desired["metadata"]["labels"]["a"]
    new = stamped(new_desired)
    # Every field of the new manifest is in the live object; only the hash tells them apart.
    assert needs_apply(new, live)
    assert difference(new, live) == "metadata.annotations.dynamo.dev/applied-hash"


def test_hash_ignores_its_own_annotation_and_key_order() -> None:
    reordered = dict(reversed(list(DESIRED.items())))
    assert manifest_hash(reordered) == manifest_hash(DESIRED)
    assert manifest_hash(stamped(DESIRED)) == manifest_hash(DESIRED)
    assert stamped(DESIRED)["metadata"]["annotations"]["dynamo.dev/applied-hash"] == (
        manifest_hash(DESIRED)
    )
    assert "annotations" not in DESIRED["metadata"]  # stamping copies


def test_booleans_are_not_quantities() -> None:
    assert difference({"a": True}, {"a": 1}) == "a"
    assert difference({"a": "1"}, {"a": 1}) is None


def test_a_hash_that_reads_as_a_huge_number_is_compared_as_a_string() -> None:
    """Seen on the test bed: an annotation's old hash matched the quantity pattern past
    Decimal's range, and the comparison raised in every reconcile of the DynamoWorker."""
    desired = stamped(DESIRED)
    live = live_copy(desired)
    live["metadata"]["annotations"] = {
        key: "31e4159265" for key in desired["metadata"]["annotations"]
    }
    assert difference(desired, live) is not None
    assert needs_apply(desired, live)
