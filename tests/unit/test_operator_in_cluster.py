"""In a pod, the operator reaches the API server at the address the kubelet puts in the
environment (as client-go's in-cluster config does), not at kopf's default DNS name, which
needs cluster DNS (the test bed has none; neither does a cluster whose DNS is down)."""

from __future__ import annotations

import pytest

from dynamo_operator.handlers.lifecycle import in_cluster_server

pytestmark = pytest.mark.unit

KOPF_DEFAULT = "https://kubernetes.default.svc"


def test_address_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "198.18.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "16443")
    assert in_cluster_server(KOPF_DEFAULT) == "https://198.18.0.1:16443"
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    assert in_cluster_server(KOPF_DEFAULT) == "https://[fd00::1]:16443"


def test_default_without_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    assert in_cluster_server(KOPF_DEFAULT) == KOPF_DEFAULT
