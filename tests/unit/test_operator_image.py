"""What can be checked about operator/Dockerfile without a Docker engine: a slim Python base
pinned by version, a builder stage apart from the final one, no build tools in the final image,
a non-root numeric USER, and an entrypoint that is the project's console script."""

from __future__ import annotations

import importlib
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from dynamo_operator import cli
from support.dockerfile import Stage, parse

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "operator" / "Dockerfile"
BUILD_TOOLS = ("build-essential", "gcc", "g++", "make", "python3-dev", "git", "pip")


def stages() -> dict[str | None, Stage]:
    _, parsed = parse(DOCKERFILE.read_text())
    assert parsed[-1].name == "final", "the last stage is the image that runs"
    return {stage.name: stage for stage in parsed}


def chain(by_name: dict[str | None, Stage], stage: Stage) -> list[Stage]:
    """`stage` and the stages it is built on, down to an external base."""
    out = [stage]
    while stage.base in by_name:
        stage = by_name[stage.base]
        out.append(stage)
    return out


def test_base_is_a_slim_python_pinned_by_version() -> None:
    by_name = stages()
    external = {s.base for s in by_name.values() if s.base not in by_name}
    assert len(external) == 1, f"one base image for builder and final: {external}"
    image = external.pop()
    name, _, tag = image.partition("@")[0].rpartition(":")
    assert name == "python", image
    assert "slim" in tag, f"{image}: use a slim base"
    # Major.minor.patch, so a rebuild gets the same interpreter.
    assert re.match(r"^3\.\d+\.\d+-slim", tag), f"{image} is not pinned to a Python release"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    minimum = tuple(int(p) for p in requires.removeprefix(">=").split("."))
    assert tuple(int(p) for p in tag.split("-")[0].split(".")[:2]) >= minimum


def test_builder_and_final_are_separate_stages() -> None:
    by_name = stages()
    assert "builder" in by_name
    final = by_name["final"]
    assert final.values("COPY") == ["--from=builder /opt/venv /opt/venv"]
    # The final image never installs anything itself.
    for stage in chain(by_name, final):
        for command in stage.values("RUN"):
            words = shlex.split(command)
            for tool in BUILD_TOOLS:
                assert tool not in words, f"{tool} in the {stage.name} stage"
            assert "apt-get" not in words, f"packages installed in the {stage.name} stage"
    # The builder removes pip from the venv it hands over.
    assert any("pip uninstall -y pip" in run for run in by_name["builder"].values("RUN"))


def test_final_stage_runs_as_a_numeric_non_root_user() -> None:
    users = stages()["final"].values("USER")
    assert users, "the final stage sets USER"
    user, _, group = users[-1].partition(":")
    # Numeric, so Kubernetes' runAsNonRoot can check it; the chart runs as the same uid.
    assert user.isdigit()
    assert int(user) != 0
    assert group.isdigit()
    values = (ROOT / "helm" / "dynamo-operator" / "values.yaml").read_text()
    assert f"runAsUser: {user}" in values


def test_entrypoint_is_the_console_script_and_cmd_runs_it() -> None:
    final = stages()["final"]
    assert final.values("ENTRYPOINT") == ['["dynamo-operator"]']
    command = json.loads(final.values("CMD")[-1])
    assert command[0] == "run"
    assert cli._parser().parse_args(command).command == "run"
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module_name, _, function = scripts["dynamo-operator"].partition(":")
    assert callable(getattr(importlib.import_module(module_name), function))
    # The image's ports are the operator's defaults (metrics, health).
    args = cli._parser().parse_args(["run", "--all-namespaces"])
    assert final.values("EXPOSE") == [f"{args.metrics_port} {args.health_port}"]
