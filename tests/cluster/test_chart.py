"""The chart against a real API server, with the real helm binary: its objects are accepted,
`helm install` runs the operator (on the test bed's process node, as the chart's
ServiceAccount) and the operator reconciles a DynamoWorker with the chart's worker default,
`helm upgrade` updates a changed CRD, `helm uninstall` keeps the CRDs, and a bad value is
refused before anything is installed.

The CRDs are cluster-wide and shared with the other tests. Installs use `--take-ownership`
(the CRDs already exist, applied by other tests or kept by an earlier release), leave the
CRDs as generated when they finish, and watch only their own namespace, so the installed
operator never touches another test's objects.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynamo_operator.api import crd
from dynamo_operator.api import metadata as dwm
from support.cluster import Cluster
from support.helm import CHART, documents, require_helm, run_helm, template

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
WORKER_IMAGE = "registry.invalid/dynamo-worker:chart-test"
OURS = [crd.custom_resource_definition(r)["metadata"]["name"] for r in crd.RESOURCES]
UPSTREAM = f"{dwm.PLURAL}.{dwm.GROUP}"
UPGRADE_MARK = " (upgraded by the chart test)"


@pytest.fixture(scope="module")
def helm() -> Path:
    return require_helm()


@contextmanager
def fresh_namespace(cluster: Cluster, *labels: str) -> Iterator[str]:
    """A new namespace (with `labels`), deleted afterwards."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    cluster.kubectl("create", "namespace", name)
    try:
        cluster.kubectl("label", "namespace", name, "dynamo.dev/test=true", *labels)
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def get_json(cluster: Cluster, *args: str) -> dict[str, Any]:
    return dict(json.loads(cluster.kubectl("get", *args, "-o", "json").stdout))


def wait_for(what: str, probe: Any, within: float, context: Any = lambda: "") -> Any:
    """Poll `probe()` until it returns a truthy value; fail after `within` seconds."""
    deadline = time.monotonic() + within
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
            if last:
                return last
        except (subprocess.CalledProcessError, KeyError, ValueError) as err:
            last = err
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {within}s (last: {last!r})\n{context()}")


def operator_log(cluster: Cluster, namespace: str) -> str:
    """The operator container's output, where the test bed's process node keeps it."""
    testbed = Path(os.environ.get("DYNAMO_TESTBED_DIR", REPO / ".testbed"))
    pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "json", check=False)
    if pods.returncode != 0:
        return ""
    tails = []
    for pod in json.loads(pods.stdout)["items"]:
        log = testbed / "pods" / pod["metadata"]["uid"] / "operator.log"
        if log.is_file():
            tails.append("\n".join(log.read_text(errors="replace").splitlines()[-60:]))
    return "operator log:\n" + "\n".join(tails)


def kubectl_apply_dry_run(cluster: Cluster, text: str, namespace: str) -> str:
    kubectl = str(cluster.bin_dir / "kubectl") if cluster.bin_dir else "kubectl"
    command = [kubectl, f"--kubeconfig={cluster.kubeconfig}", "apply", "--dry-run=server"]
    result = subprocess.run(
        [*command, "-n", namespace, "-f", "-"],
        input=text,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"the API server refused the chart's objects:\n{result.stderr}"
    return result.stdout


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"metrics": {"serviceMonitor": {"enabled": True}}},
        {"rbac": {"scope": "namespaced"}},
    ],
    ids=["default", "metrics", "namespaced"],
)
def test_rendered_objects_are_accepted_by_the_api_server(
    helm: Path, cluster: Cluster, values: dict[str, Any]
) -> None:
    with fresh_namespace(cluster) as namespace:
        text = template(helm, values, release="dryrun", namespace=namespace).stdout
        docs = documents(text)
        have_monitoring = (
            cluster.kubectl(
                "get", "crd", "servicemonitors.monitoring.coreos.com", check=False
            ).returncode
            == 0
        )
        if not have_monitoring:  # the test bed has no Prometheus Operator
            docs = [d for d in docs if d["kind"] != "ServiceMonitor"]
        out = kubectl_apply_dry_run(cluster, yaml.safe_dump_all(docs), namespace)
        accepted = [line for line in out.splitlines() if line.endswith("(server dry run)")]
        assert len(accepted) == len(docs), out


def test_bad_value_is_refused_before_anything_is_installed(helm: Path, cluster: Cluster) -> None:
    with fresh_namespace(cluster) as namespace:
        result = run_helm(
            helm,
            "install",
            "bad-values",
            str(CHART),
            "-n",
            namespace,
            "--set-json",
            'rbac={"scope": "everywhere"}',
            kubeconfig=cluster.kubeconfig,
            check=False,
        )
        assert result.returncode != 0
        assert "at '/rbac/scope': value must be one of 'cluster', 'namespaced'" in result.stderr
        status = run_helm(
            helm,
            "status",
            "bad-values",
            "-n",
            namespace,
            kubeconfig=cluster.kubeconfig,
            check=False,
        )
        assert "release: not found" in status.stderr


def crd_description(cluster: Cluster, name: str) -> str:
    found = get_json(cluster, "crd", name)
    return str(found["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["description"])


def patched_chart(tmp_path: Path) -> Path:
    """A copy of the chart whose LoRAAdapter CRD has a changed description."""
    copy = tmp_path / "dynamo-operator"
    shutil.copytree(CHART, copy)
    path = copy / crd.CHART_CRD_DIR / "dynamo.dev_loraadapters.yaml"
    text = path.read_text()
    lora = crd.custom_resource_definition(crd.LoRAAdapter)
    description = lora["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["description"]
    line = f"        description: {description}\n"
    assert text.count(line) == 1, "the CRD template's top-level description moved"
    path.write_text(text.replace(line, f"        description: {description}{UPGRADE_MARK}\n"))
    return copy


def release_annotations(cluster: Cluster, name: str) -> dict[str, str]:
    return dict(get_json(cluster, "crd", name)["metadata"].get("annotations") or {})


def test_install_upgrade_uninstall(helm: Path, cluster: Cluster, tmp_path: Path) -> None:
    if not cluster.is_testbed:
        pytest.skip("runs the operator on the test bed's process node")
    release = f"chart-{uuid.uuid4().hex[:6]}"
    fullname = f"{release}-dynamo-operator"  # the chart's object names
    upstream_before = release_annotations(cluster, UPSTREAM) if _exists(cluster, UPSTREAM) else None
    with (
        fresh_namespace(cluster, "pod-security.kubernetes.io/enforce=restricted") as home,
        fresh_namespace(cluster) as watched,
    ):
        values = {
            "rbac": {"scope": "namespaced", "watchNamespaces": [watched]},
            "workerDefaults": {"image": WORKER_IMAGE},
            # The process node runs the operator for real (it ignores images, so the chart's
            # explicit command is what runs).
            "nodeSelector": {"dynamo.dev/node-kind": "process"},
            "tolerations": [
                {"key": "dynamo.dev/process-node", "operator": "Exists", "effect": "NoSchedule"}
            ],
        }
        values_file = tmp_path / "values.json"
        values_file.write_text(json.dumps(values))

        def helm_(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
            return run_helm(helm, *args, "-n", home, kubeconfig=cluster.kubeconfig, check=check)

        def context() -> str:
            return operator_log(cluster, home)

        installed = False
        try:
            # --take-ownership: the CRDs exist already (other tests, earlier releases).
            result = helm_(
                "install", release, str(CHART), "-f", str(values_file), "--take-ownership",
                "--wait", "--timeout", "180s", check=False,
            )  # fmt: skip
            installed = result.returncode == 0
            assert installed, f"helm install failed:\n{result.stderr}\n{context()}"
            assert "examples/dynamoworker-minimal.yaml" in result.stdout, "NOTES say what next"
            _check_installed(cluster, release, home, watched, upstream_before)
            _check_operator_reconciles(cluster, watched, context)

            # An upgrade with a changed CRD updates it; an upgrade back restores it.
            generated = crd_description(cluster, "loraadapters.dynamo.dev")
            helm_("upgrade", release, str(patched_chart(tmp_path)), "-f", str(values_file))
            assert crd_description(cluster, "loraadapters.dynamo.dev") == generated + UPGRADE_MARK
            helm_("upgrade", release, str(CHART), "-f", str(values_file), "--wait")
            assert crd_description(cluster, "loraadapters.dynamo.dev") == generated

            # The operator's finalizer goes with the DynamoWorker while the operator runs.
            cluster.kubectl("delete", "dynamoworker", "qwen3", "-n", watched, "--timeout=60s")
            helm_("uninstall", release, "--wait", "--timeout", "120s")
            installed = False
            for name in OURS:
                assert _exists(cluster, name), f"helm uninstall removed CRD {name}"
                assert release_annotations(cluster, name)["helm.sh/resource-policy"] == "keep"
            assert _exists(cluster, UPSTREAM)
            assert not _exists(cluster, f"{fullname}-crds", kind="clusterrole")
            assert not _exists(cluster, fullname, kind="role", namespace=watched)
            assert not _exists(cluster, fullname, kind="deployment", namespace=home)
        finally:
            if installed:
                helm_("uninstall", release, "--wait", "--timeout", "120s", check=False)
            # Never leave a DynamoWorker whose finalizer no operator will remove.
            with suppress(subprocess.CalledProcessError):
                cluster.kubectl(
                    "patch", "dynamoworker", "qwen3", "-n", watched, "--type=merge",
                    "-p", '{"metadata":{"finalizers":null}}',
                )  # fmt: skip


def _exists(
    cluster: Cluster, name: str, *, kind: str = "crd", namespace: str | None = None
) -> bool:
    where = ["-n", namespace] if namespace else []
    return cluster.kubectl("get", kind, name, *where, check=False).returncode == 0


def _check_installed(
    cluster: Cluster,
    release: str,
    home: str,
    watched: str,
    upstream_before: dict[str, str] | None,
) -> None:
    # Our CRDs now belong to the release, and are kept on uninstall.
    for name in OURS:
        annotations = release_annotations(cluster, name)
        assert annotations["meta.helm.sh/release-name"] == release
        assert annotations["meta.helm.sh/release-namespace"] == home
        assert annotations["helm.sh/resource-policy"] == "keep"
    # Upstream's CRD: left alone when a copy existed that this release does not own.
    upstream_after = release_annotations(cluster, UPSTREAM)
    if upstream_before is not None:
        assert upstream_after.get("meta.helm.sh/release-name") == upstream_before.get(
            "meta.helm.sh/release-name"
        )
    else:
        assert upstream_after["meta.helm.sh/release-name"] == release
    # RBAC in the watched namespace for the ServiceAccount of the release namespace.
    fullname = f"{release}-dynamo-operator"
    binding = get_json(cluster, "rolebinding", fullname, "-n", watched)
    account = {"kind": "ServiceAccount", "name": fullname, "namespace": home}
    assert binding["subjects"] == [account]
    assert _exists(cluster, f"{fullname}-crds", kind="clusterrole")
    # The operator runs (readiness passed on /healthz) in a namespace enforcing the
    # `restricted` Pod Security Standard, so its pod is compliant.
    deployment = get_json(cluster, "deployment", fullname, "-n", home)
    assert deployment["status"].get("readyReplicas") == 2
    # One of the two replicas holds the leader-election Lease (its identity starts with the
    # pod's name); the other stands by.
    pods = get_json(cluster, "pods", "-n", home, "-l", "app.kubernetes.io/name=dynamo-operator")
    names = {p["metadata"]["name"] for p in pods["items"]}
    lease = get_json(cluster, "lease", f"{fullname}-leader", "-n", home)
    assert lease["spec"]["holderIdentity"].rpartition("_")[0] in names, (lease, names)
    assert _exists(cluster, f"{fullname}-metrics", kind="service", namespace=home)


def _check_operator_reconciles(cluster: Cluster, watched: str, context: Any) -> None:
    """The chart's operator, as the chart's ServiceAccount, reconciles the minimal example
    with the worker image the chart passed it."""
    cluster.kubectl("apply", "-n", watched, "-f", str(EXAMPLES / "dynamoworker-minimal.yaml"))

    def child_image() -> str | None:
        found = cluster.kubectl("get", "deployment", "qwen3", "-n", watched, "-o", "json")
        spec = json.loads(found.stdout)["spec"]["template"]["spec"]
        return str(spec["containers"][0]["image"])

    assert wait_for("the worker Deployment", child_image, 90, context) == WORKER_IMAGE

    def status_written() -> bool:
        worker = get_json(cluster, "dynamoworker", "qwen3", "-n", watched)
        status = worker.get("status") or {}
        return bool(status.get("observedGeneration") == worker["metadata"]["generation"])

    wait_for("DynamoWorker status", status_written, 90, context)
