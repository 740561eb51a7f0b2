"""The release workflow (.github/workflows/release.yaml), which cannot run here: actionlint (built
from the Go module proxy by hack/build-actionlint) passes it, and it publishes every Dockerfile
of the repository, for both architectures with an SBOM, where the chart's defaults look."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "release.yaml"
VALUES = ROOT / "helm" / "dynamo-operator" / "values.yaml"


def workflow() -> dict[Any, Any]:
    loaded: dict[Any, Any] = yaml.safe_load(WORKFLOW.read_text())
    return loaded


def build_step(job: dict[str, Any]) -> dict[str, Any]:
    return next(s for s in job["steps"] if s.get("uses", "").startswith("docker/build-push-action"))


def test_actionlint_passes() -> None:
    built = subprocess.run(
        [str(ROOT / "hack" / "build-actionlint")], capture_output=True, text=True, check=False
    )
    assert built.returncode == 0, built.stderr
    lint = subprocess.run(
        [built.stdout.strip(), "-no-color", str(WORKFLOW)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_every_dockerfile_is_published_for_both_architectures_with_an_sbom() -> None:
    images = workflow()["jobs"]["images"]
    matrix = images["strategy"]["matrix"]["include"]
    dockerfiles = {str(p.relative_to(ROOT)) for p in ROOT.glob("*/Dockerfile*")}
    assert {entry["dockerfile"] for entry in matrix} == dockerfiles
    step = build_step(images)["with"]
    assert set(step["platforms"].split(",")) == {"linux/amd64", "linux/arm64"}
    assert step["sbom"] is True
    assert step["push"] is True
    # Nothing pushes on anything but a version tag.
    assert set(workflow()[True]) == {"push"}  # YAML 1.1 reads the key `on` as True
    assert set(workflow()[True]["push"]) == {"tags"}


def test_the_chart_defaults_name_the_published_images() -> None:
    registry = workflow()["env"]["REGISTRY"]
    published = {
        f"{registry}/{e['image']}"
        for e in workflow()["jobs"]["images"]["strategy"]["matrix"]["include"]
    }
    values = yaml.safe_load(VALUES.read_text())
    defaults = values["workerDefaults"]
    named = {
        values["image"]["repository"],
        defaults["image"],
        defaults["vllmImage"],
        defaults["frontendImage"],
    }
    assert named == published
