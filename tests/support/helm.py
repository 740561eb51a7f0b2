"""The real `helm` binary from the test bed, and the chart under test.

`helm_binary()` looks where the test bed keeps its binaries (`$DYNAMO_K8S_BIN_DIR`, the build
cache keyed by hack/versions.env, the running test bed's `bin-dir` marker), then on PATH.
Tests that need helm skip with a reason when none is found.

The test bed's helm is built from source without the version stamps Helm's release builds
carry, so on its own it assumes Kubernetes v1.20 for `helm template` and `helm lint`; the
helpers pass `--kube-version` explicitly (the chart's oldest supported release for rendering,
so golden files do not depend on the test bed's version).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "dynamo-operator"
# The oldest Kubernetes release the chart supports (Chart.yaml kubeVersion).
RENDER_KUBE_VERSION = "1.30.0"


def _versions() -> dict[str, str]:
    versions = {}
    for line in (REPO / "hack" / "versions.env").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.startswith("#"):
            versions[key.strip()] = value.strip()
    return versions


def _candidates() -> list[Path]:
    dirs: list[Path] = []
    if os.environ.get("DYNAMO_K8S_BIN_DIR"):
        dirs.append(Path(os.environ["DYNAMO_K8S_BIN_DIR"]))
    v = _versions()
    cache = Path(
        os.environ.get("DYNAMO_TESTBED_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dynamo-testbed"
    )
    key = (
        f"k8s-{v.get('K8S_VERSION')}_etcd-{v.get('ETCD_VERSION')}"
        f"_kwok-{v.get('KWOK_VERSION')}_helm-{v.get('HELM_VERSION')}"
    )
    dirs.append(cache / "bin" / key)
    marker = Path(os.environ.get("DYNAMO_TESTBED_DIR", REPO / ".testbed")) / "bin-dir"
    if marker.is_file():
        dirs.append(Path(marker.read_text().strip()))
    found = [d / "helm" for d in dirs if (d / "helm").is_file()]
    on_path = shutil.which("helm")
    return [*found, *([Path(on_path)] if on_path else [])]


def helm_binary() -> Path | None:
    """The helm binary to test with, or None."""
    candidates = _candidates()
    return candidates[0] if candidates else None


def require_helm() -> Path:
    """The helm binary, or skip the test with the reason."""
    helm = helm_binary()
    if helm is None:
        pytest.skip(
            "needs the helm binary: build the test bed (hack/build-binaries) or set "
            "DYNAMO_K8S_BIN_DIR"
        )
    return helm


def run_helm(
    helm: Path, *args: str, kubeconfig: Path | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run helm (against `kubeconfig` when given); raise with its output when it fails."""
    env = {**os.environ}
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    result = subprocess.run(
        [str(helm), *args], capture_output=True, text=True, env=env, check=False, timeout=300
    )
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stderr}{result.stdout}")
    return result


def set_args(values: dict[str, Any]) -> list[str]:
    """`--set-json` arguments for `values` (one per top-level key)."""
    return [
        arg for key, value in values.items() for arg in ("--set-json", f"{key}={json.dumps(value)}")
    ]


def template(
    helm: Path,
    values: dict[str, Any] | None = None,
    *,
    release: str = "dynamo-operator",
    namespace: str = "dynamo-system",
    chart: Path = CHART,
    extra: Sequence[str] = (),
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """`helm template` of the chart with `values`."""
    return run_helm(
        helm,
        "template",
        release,
        str(chart),
        "--namespace",
        namespace,
        "--kube-version",
        RENDER_KUBE_VERSION,
        *set_args(values or {}),
        *extra,
        check=check,
    )


def documents(text: str) -> list[dict[str, Any]]:
    """The non-empty YAML documents of a multi-document stream."""
    return [doc for doc in yaml.safe_load_all(text) if doc]
