"""Fixtures of the cluster tests."""

from support.dynamo_workers import crds

__all__ = ["crds"]
