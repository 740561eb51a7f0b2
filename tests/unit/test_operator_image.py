"""What can be checked about operator/Dockerfile without a Docker engine: a slim Python base
pinned by version (and overridable), dependencies in a layer before the project's code, no build
tools anywhere, a non-root numeric USER, and an entrypoint that is the project's console script.
The image itself is built and run by tests/images."""

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
BUILD_TOOLS = ("build-essential", "gcc", "g++", "make", "python3-dev", "git")


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


def test_base_is_a_build_arg_defaulting_to_a_slim_python_pinned_by_version() -> None:
    args, parsed = parse(DOCKERFILE.read_text())
    by_name = {stage.name: stage for stage in parsed}
    external = {s.base for s in parsed if s.base not in by_name}
    assert external == {"${BASE_IMAGE}"}, "one base image, which a build may replace"
    image = args["BASE_IMAGE"]
    name, _, tag = image.partition("@")[0].rpartition(":")
    assert name == "python", image
    assert "slim" in tag, f"{image}: use a slim base"
    # Major.minor.patch, so a rebuild gets the same interpreter.
    assert re.match(r"^3\.\d+\.\d+-slim", tag), f"{image} is not pinned to a Python release"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    minimum = tuple(int(p) for p in requires.removeprefix(">=").split("."))
    assert tuple(int(p) for p in tag.split("-")[0].split(".")[:2]) >= minimum


def test_dependencies_go_in_before_the_code_and_no_stage_installs_build_tools() -> None:
    by_name = stages()
    final = by_name["final"]
    runs = {stage.name: " ".join(stage.values("RUN")) for stage in chain(by_name, final)}
    # The dependencies' layer reads only pyproject.toml: a code change leaves it cached.
    assert "requirements operator" in runs["deps"]
    assert "type=cache,target=/root/.cache/pip" in runs["deps"]
    assert "pip install --no-deps /tmp/build" in runs["final"]
    for stage in chain(by_name, final):
        for command in stage.values("RUN"):
            words = shlex.split(command)
            for tool in BUILD_TOOLS:
                assert tool not in words, f"{tool} in the {stage.name} stage"
            assert "apt-get" not in words, f"packages installed in the {stage.name} stage"


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
