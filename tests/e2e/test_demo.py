"""The demo command (README.md, docs/getting-started/demo.md), end to end: `hack/demo` brings
up the whole system and shows completions from the base model and each adapter, from a worker
pod and through upstream's frontend; `hack/demo down` leaves nothing behind."""

from __future__ import annotations

import subprocess

import pytest

from support.cluster import HACK, Cluster

pytestmark = pytest.mark.e2e


@pytest.mark.order_last
def test_demo_runs_end_to_end_and_down_leaves_nothing(testbed: Cluster) -> None:
    up = subprocess.run(
        [str(HACK / "demo")], capture_output=True, text=True, timeout=900, check=False
    )
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    worker, _, frontend = up.stdout.partition("upstream's frontend at its Service")
    assert frontend, up.stdout[-3000:]
    for model in ("tiny-llama", "sql-lora", "poet-lora"):
        assert f"chat completion from {model}" in worker
        assert f"chat completion from {model}" in frontend
    assert "dp_rank=" in up.stdout
    assert "published token budget {'combinedLimit': 2048" in up.stdout

    down = subprocess.run(
        [str(HACK / "demo"), "down"], capture_output=True, text=True, timeout=300, check=False
    )
    assert down.returncode == 0, down.stderr[-3000:]
    assert "nothing left behind" in down.stderr + down.stdout
