"""The `cluster` and `namespace` fixtures: a real Kubernetes API server for the tests.

`cluster` reuses a running cluster when KUBECONFIG points at one that answers; otherwise it
starts the test bed (`hack/cluster up`) and stops it at the end of the session. Only the
test bed has the process node and the guarded pod network; tests that need them ask for
`testbed` and skip elsewhere.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import pytest_asyncio
import yaml
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

REPO = Path(__file__).resolve().parents[2]
HACK = REPO / "hack"
T = TypeVar("T")


@dataclass(frozen=True)
class Cluster:
    kubeconfig: Path
    bin_dir: Path | None  # where kubectl and helm live (the test bed's binaries)
    is_testbed: bool  # ours: the process node and the guarded pod network exist
    started_here: bool

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        kubectl = str(self.bin_dir / "kubectl") if self.bin_dir else "kubectl"
        return subprocess.run(
            [kubectl, f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            check=check,
        )


def hack_cluster(*args: str) -> subprocess.CompletedProcess[str]:
    """Run `hack/cluster ARGS` (its progress goes to the test log)."""
    return subprocess.run(
        [str(HACK / "cluster"), *args], capture_output=True, text=True, check=False
    )


def _answers(kubeconfig: str) -> bool:
    probe = ["kubectl", f"--kubeconfig={kubeconfig}", "get", "--raw", "/readyz"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=10, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _testbed_kubeconfig() -> Path:
    return Path(os.environ.get("DYNAMO_TESTBED_DIR", REPO / ".testbed")) / "admin.kubeconfig"


def _bin_dir() -> Path | None:
    marker = Path(os.environ.get("DYNAMO_TESTBED_DIR", REPO / ".testbed")) / "bin-dir"
    return Path(marker.read_text().strip()) if marker.exists() else None


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    external = os.environ.get("KUBECONFIG")
    ours = _testbed_kubeconfig()
    if external and Path(external).resolve() != ours.resolve() and _answers(external):
        yield Cluster(Path(external), None, is_testbed=False, started_here=False)
        return
    status = hack_cluster("status")
    started_here = status.returncode != 0
    if started_here:
        result = hack_cluster("up")
        if result.returncode != 0:
            pytest.fail(f"hack/cluster up failed:\n{result.stderr[-4000:]}")
    yield Cluster(ours, _bin_dir(), is_testbed=True, started_here=started_here)
    if started_here:
        result = hack_cluster("down")
        assert result.returncode == 0, f"hack/cluster down failed:\n{result.stderr[-4000:]}"


@pytest.fixture(scope="session")
def testbed(cluster: Cluster) -> Cluster:
    if not cluster.is_testbed:
        pytest.skip("needs the test bed's process node and pod network (KUBECONFIG is external)")
    return cluster


@pytest_asyncio.fixture(scope="session")
async def api(cluster: Cluster) -> AsyncIterator[client.ApiClient]:
    """An admin API client for the whole session."""
    cfg = client.Configuration()
    await config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=cfg)
    async with client.ApiClient(cfg) as api_client:
        yield api_client


async def create_test_namespace(api: client.ApiClient, prefix: str = "t") -> str:
    """A fresh namespace, labelled as a test's, with its `default` ServiceAccount."""
    core = client.CoreV1Api(api)
    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    body: Any = {"metadata": {"name": name, "labels": {"dynamo.dev/test": "true"}}}
    await core.create_namespace(body)
    # Pods need the namespace's `default` ServiceAccount, which a controller creates (after
    # the fault suite's apiserver restarts too: `hack/cluster restart-apiserver` returns only
    # once the controllers act again).
    await eventually(lambda: core.read_namespaced_service_account("default", name), 30)
    return name


@pytest_asyncio.fixture
async def namespace(api: client.ApiClient) -> AsyncIterator[str]:
    """A fresh namespace per test, deleted afterwards."""
    name = await create_test_namespace(api)
    yield name
    await client.CoreV1Api(api).delete_namespace(name)


async def eventually(
    probe: Callable[[], Awaitable[T]],
    within: float,
    until: Callable[[T], bool] = lambda _: True,
    every: float = 0.2,
) -> T:
    """Await `probe()` until it returns a value satisfying `until` (exceptions count as not
    yet), or fail after `within` seconds with the last value or error."""
    deadline = time.monotonic() + within
    last: Any = None
    while True:
        try:
            last = await probe()
            if until(last):
                return last
        except Exception as exc:  # not yet: the object may not exist
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within}s; last: {last!r}")
        await asyncio.sleep(every)


async def ensure_crd(api: client.ApiClient, path: Path) -> None:
    """Create the CRD in the YAML file at `path` unless it exists; wait until Established."""
    ext = client.ApiextensionsV1Api(api)
    body = yaml.safe_load(await asyncio.to_thread(path.read_text))
    try:
        await ext.create_custom_resource_definition(body)
    except ApiException as exc:
        if exc.status != 409:  # already there: from an earlier test, or upstream's own
            raise

    async def established() -> bool:
        got = await ext.read_custom_resource_definition(body["metadata"]["name"])
        return any(
            c.type == "Established" and c.status == "True" for c in got.status.conditions or []
        )

    await eventually(established, 60, bool)
