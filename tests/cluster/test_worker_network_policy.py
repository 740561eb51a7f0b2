"""The worker pods' NetworkPolicy as the real API server takes it: every variant is accepted
and stored exactly as built (so the operator's apply-when-changed comparison stays quiet).
Who it admits is checked end to end by tests/e2e/test_lora_adapter.py, where the test bed's
policy agent enforces it."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamo_operator.api import DynamoWorker
from dynamo_operator.reconcile.dynamoworker.builders import desired_network_policy
from dynamo_operator.reconcile.dynamoworker.settings import ReconcileSettings
from support.api_cases import dynamo_worker

pytestmark = pytest.mark.cluster

VARIANTS = {
    "default": ({}, ReconcileSettings(operator_namespace="dynamo-system")),
    "operator-anywhere": ({}, ReconcileSettings()),
    "frontend-and-namespaces": (
        {
            "frontend": {},
            "networkPolicy": {
                "systemPortNamespaces": ["monitoring", "observability"],
                "clientNamespaces": ["gateway"],
            },
        },
        ReconcileSettings(operator_namespace="ops"),
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
async def test_the_policy_is_accepted_and_stored_as_built(
    api: client.ApiClient, namespace: str, variant: str
) -> None:
    spec, settings = VARIANTS[variant]
    manifest = dynamo_worker("llm", spec=spec)
    manifest["metadata"] |= {"namespace": namespace, "uid": "6f1c0c64-0000-4000-8000-000000000001"}
    policy = desired_network_policy(DynamoWorker.model_validate(manifest), settings)
    body: Any = {**policy, "metadata": {**policy["metadata"], "ownerReferences": None}}
    stored = await client.NetworkingV1Api(api).create_namespaced_network_policy(
        namespace, body, dry_run="All"
    )
    as_stored = api.sanitize_for_serialization(stored.spec)
    assert as_stored == policy["spec"]
