"""Fixtures shared by every test directory, and the phase timings `hack/test` reports."""

import os
import subprocess
import time
from collections.abc import Generator

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


# hack/test names a file here; each test phase and each session fixture's setup is appended as
# it ends, so its closing table (hack/testtimes.py) has them even when pytest is killed.
PHASES_ENV = "DYNAMO_TEST_PHASES"


def _record_phase(nodeid: str, when: str, seconds: float, outcome: str) -> None:
    path = os.environ.get(PHASES_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as phases:
            phases.write(f"{nodeid}\t{when}\t{seconds:.3f}\t{outcome}\n")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _record_phase(report.nodeid, report.when, report.duration, report.outcome)


class SessionFixtureTimer:
    """A session fixture's setup (the test bed, the kubelet node's image imports) is timed on
    its own (with the session fixtures it asks for first): in the phases above it hides in the
    setup of whichever test first asked for it.
    A plugin, not a conftest hook: pytest asks the session node's hooks for a session
    fixture, and those do not include a conftest below the root."""

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(
        self, fixturedef: pytest.FixtureDef[object]
    ) -> Generator[None, object, object]:
        started = time.monotonic()
        try:
            return (yield)
        finally:
            if fixturedef.scope == "session":
                seconds = time.monotonic() - started
                _record_phase(f"fixture:{fixturedef.argname}", "setup", seconds, "-")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SessionFixtureTimer(), "session-fixture-timer")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cluster-split",
        choices=("with", "without"),
        help="run only the tests that use a Kubernetes cluster (the `cluster` fixture) or only "
        "those that do not: hack/test runs the two halves in two pytests side by side",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `order_last` run after all others (they restart shared fixtures).
    `--cluster-split` deselects by fixture closure, so a test's half follows what it uses."""
    split = config.getoption("--cluster-split")
    if split is not None:
        wanted = split == "with"
        deselected = [item for item in items if _uses_cluster(item) != wanted]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if _uses_cluster(item) == wanted]
    items.sort(key=lambda item: item.get_closest_marker("order_last") is not None)


def _uses_cluster(item: pytest.Item) -> bool:
    return "cluster" in getattr(item, "fixturenames", ())


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
