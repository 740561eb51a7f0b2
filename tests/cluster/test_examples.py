"""Every manifest under examples/ is accepted by the API server with the CRDs from crds/
(server-side dry run: schema, CEL rules, defaulting, nothing stored), and a broken copy is
refused, so the check can fail."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from support.cluster import Cluster

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
CRDS = sorted((REPO / "crds").glob("*.yaml"))


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> None:
    """The CRDs from crds/, applied as a user would (server-side), and Established."""
    cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "--field-manager=dynamo-tests",
        *(arg for path in CRDS for arg in ("-f", str(path))),
    )  # fmt: skip
    names = [yaml.safe_load(path.read_text())["metadata"]["name"] for path in CRDS]
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    *(f"crd/{name}" for name in names))  # fmt: skip


@pytest.fixture
def example_namespace(cluster: Cluster, crds: None) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:10]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def dry_run(cluster: Cluster, namespace: str, text: str) -> subprocess.CompletedProcess[str]:
    kubectl = str(cluster.bin_dir / "kubectl") if cluster.bin_dir else "kubectl"
    command = [kubectl, f"--kubeconfig={cluster.kubeconfig}", "apply", "--dry-run=server"]
    return subprocess.run(
        [*command, "-n", namespace, "-f", "-"],
        input=text,
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_is_accepted(cluster: Cluster, example_namespace: str, path: Path) -> None:
    result = dry_run(cluster, example_namespace, path.read_text())
    assert result.returncode == 0, f"{path.name} refused:\n{result.stderr}"
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    accepted = [line for line in result.stdout.splitlines() if "(server dry run)" in line]
    assert len(accepted) == len(documents), result.stdout
    # Nothing was stored.
    listing = cluster.kubectl("get", "dw,lora", "-n", example_namespace, "-o", "name")
    assert listing.stdout.strip() == ""


def test_a_broken_example_is_refused_naming_the_field(
    cluster: Cluster, example_namespace: str
) -> None:
    manifest = yaml.safe_load((REPO / "examples" / "dynamoworker-minimal.yaml").read_text())
    manifest["spec"]["model"]["source"] = "gs://bucket/model"
    result = dry_run(cluster, example_namespace, yaml.safe_dump(manifest))
    assert result.returncode != 0
    assert "spec.model.source" in result.stderr
