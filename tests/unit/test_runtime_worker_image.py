"""What can be checked about worker_image/Dockerfile without a Docker engine. The image itself
is built and run by tests/images."""

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


def test_base_and_torch_index_are_build_args_with_pinned_cuda_defaults() -> None:
    args, stages = parse(DOCKERFILE.read_text())
    internal = {stage.name for stage in stages if stage.name}
    assert {s.base for s in stages if s.base not in internal} == {"${BASE_IMAGE}"}
    name, _, tag = args["BASE_IMAGE"].rpartition(":")
    assert name == "nvidia/cuda", args["BASE_IMAGE"]
    assert re.match(r"\d+\.\d+\.\d+-runtime-", tag), "a CUDA runtime image pinned by version"
    assert args["TORCH_INDEX_URL"].startswith("https://download.pytorch.org/whl/cu")
    deps = next(stage for stage in stages if stage.name == "deps")
    install = " ".join(deps.values("RUN"))
    assert '--extra-index-url "${TORCH_INDEX_URL}"' in install
    assert "requirements worker engine" in install


def test_final_stage_runs_as_non_root_without_build_tools() -> None:
    _, stages = parse(DOCKERFILE.read_text())
    by_name = {stage.name: stage for stage in stages}
    final = by_name["final"]
    assert stages[-1] is final
    users = final.values("USER")
    assert users, "the final stage sets USER"
    assert users[-1].split(":")[0] not in ("root", "0")
    # Everything the final image is made of: the final stage and the stages below it.
    for stage in (final, by_name["deps"], by_name["base"]):
        for command in stage.values("RUN"):
            for tool in BUILD_TOOLS:
                assert tool not in shlex.split(command), f"{tool} installed in {stage.name}"
    assert " ".join(final.values("RUN")).count("pip install --no-deps /tmp/build") == 1


def test_entrypoint_is_the_console_script() -> None:
    _, stages = parse(DOCKERFILE.read_text())
    assert stages[-1].values("ENTRYPOINT") == ['["dynamo-worker"]']
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module_name, _, function = scripts["dynamo-worker"].partition(":")
    assert (module_name, function) == ("dynamo.runtime.cli", "main")
    assert callable(getattr(importlib.import_module(module_name), function))
