"""The thin client layer over kubernetes_asyncio (no kopf here)."""

from dynamo_operator.k8s.client import ApiError, Cluster, connect

__all__ = ["ApiError", "Cluster", "connect"]
