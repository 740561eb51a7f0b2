"""What can be checked about worker_image/Dockerfile without a Docker engine."""

from __future__ import annotations

import importlib
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from support.dockerfile import parse

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "worker_image" / "Dockerfile"
BUILD_TOOLS = ("build-essential", "gcc", "g++", "make", "python3-dev", "git")


def test_dockerfile_stages() -> None:
    args, stages = parse(DOCKERFILE.read_text())
    names = [stage.name for stage in stages]
    assert "builder" in names
    assert names[-1] == "final", "the last stage is the image that runs"
    # A CPU variant by build arg: base-${VARIANT} picks base-gpu (default) or base-cpu.
    assert args["VARIANT"] == "gpu"
    assert {"base-gpu", "base-cpu"} <= set(names)
    base = next(stage for stage in stages if stage.name == "base")
    assert base.base == "base-${VARIANT}"


def test_external_bases_are_pinned() -> None:
    _, stages = parse(DOCKERFILE.read_text())
    internal = {stage.name for stage in stages if stage.name}
    # `base-${VARIANT}` and other stage names are internal; the rest come from a registry.
    external = [s.base for s in stages if s.base not in internal and "${" not in s.base]
    assert external, "expected external base images"
    for image in external:
        if "@sha256:" in image:
            continue
        name, _, tag = image.rpartition(":")
        assert name, f"{image} has no tag: pin it by version or digest"
        assert tag != "latest", f"{image} is not pinned by version or digest"
        assert re.search(r"\d+\.\d+", tag), f"{image}: tag {tag!r} names no version"
    gpu = next(stage for stage in stages if stage.name == "base-gpu")
    assert gpu.base.startswith("nvidia/cuda:")
    assert "runtime" in gpu.base, "the GPU base is a CUDA runtime image, not devel"


def test_final_stage_runs_as_non_root_without_build_tools() -> None:
    _, stages = parse(DOCKERFILE.read_text())
    by_name = {stage.name: stage for stage in stages}
    final = by_name["final"]
    users = [value for keyword, value in final.instructions if keyword == "USER"]
    assert users, "the final stage sets USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    # Everything the final image is made of: the final stage and the bases below it.
    chain = [final, by_name["base"], by_name["base-gpu"], by_name["base-cpu"]]
    for stage in chain:
        for keyword, value in stage.instructions:
            if keyword == "RUN":
                for tool in BUILD_TOOLS:
                    assert tool not in shlex.split(value), f"{tool} installed in {stage.name}"
    copies = [value for keyword, value in final.instructions if keyword == "COPY"]
    assert copies == ["--from=builder /opt/venv /opt/venv"]


def test_entrypoint_is_the_console_script() -> None:
    _, stages = parse(DOCKERFILE.read_text())
    entrypoints = [value for keyword, value in stages[-1].instructions if keyword == "ENTRYPOINT"]
    assert entrypoints == ['["dynamo-worker"]']
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module_name, _, function = scripts["dynamo-worker"].partition(":")
    assert (module_name, function) == ("dynamo.runtime.cli", "main")
    assert callable(getattr(importlib.import_module(module_name), function))
