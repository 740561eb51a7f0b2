"""The workflows (.github/workflows), which cannot run here: actionlint (built from the Go module
proxy by hack/build-actionlint) passes each; the release publishes every Dockerfile of the
repository, for both architectures with an SBOM, where the chart's defaults look; and CI runs
`.ci/run` on pull requests."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
WORKFLOW = WORKFLOWS / "release.yaml"
CI = WORKFLOWS / "ci.yaml"
VALUES = ROOT / "helm" / "dynamo-operator" / "values.yaml"


def workflow(path: Path = WORKFLOW) -> dict[Any, Any]:
    loaded: dict[Any, Any] = yaml.safe_load(path.read_text())
    return loaded


def build_step(job: dict[str, Any]) -> dict[str, Any]:
    return next(s for s in job["steps"] if s.get("uses", "").startswith("docker/build-push-action"))


@pytest.fixture(scope="module")
def actionlint() -> str:
    built = subprocess.run(
        [str(ROOT / "hack" / "build-actionlint")], capture_output=True, text=True, check=False
    )
    assert built.returncode == 0, built.stderr
    return built.stdout.strip()


@pytest.mark.parametrize("path", sorted(WORKFLOWS.glob("*.y*ml")), ids=lambda p: p.name)
def test_actionlint_passes(actionlint: str, path: Path) -> None:
    lint = subprocess.run(
        [actionlint, "-no-color", str(path)],
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


def test_ci_runs_the_test_command_on_pull_requests() -> None:
    ci = workflow(CI)
    assert "pull_request" in ci[True]  # YAML 1.1 reads the key `on` as True
    runs = [step.get("run", "") for job in ci["jobs"].values() for step in job["steps"]]
    assert any(".ci/run" in run.split() for run in runs)
