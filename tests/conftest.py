"""Fixtures shared by every test directory."""

import subprocess

import pytest

from support.cluster import api, cluster, namespace, testbed
from support.images import images, node_images
from support.loopback_http import closed_default_http_client
from support.s3 import s3_server
from support.tiny_model import tiny_model

__all__ = [
    "api",
    "closed_default_http_client",
    "cluster",
    "images",
    "namespace",
    "node_images",
    "s3_server",
    "testbed",
    "tiny_model",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `order_last` run after all others (they restart shared fixtures)."""
    items.sort(key=lambda item: item.get_closest_marker("order_last") is not None)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """`gpu` tests need a CUDA device and `kind` tests a Docker daemon; skip with the reason."""
    if item.get_closest_marker("gpu") and not _cuda_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False here)")
    if item.get_closest_marker("kind") and not _docker_answers():
        pytest.skip("needs a Docker daemon for kind (`docker info` does not answer here)")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _docker_answers() -> bool:
    try:
        result = subprocess.run(["docker", "info"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0
