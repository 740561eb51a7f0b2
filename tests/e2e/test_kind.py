"""hack/kind-e2e end to end: both images built, a kind cluster, the chart installed, the
examples accepted, a CPU worker with the tiny model Ready and a local adapter loaded.

Marked `kind`: it runs only where a Docker daemon answers (tests/conftest.py skips it
elsewhere with the reason) and where the `kind` binary is on PATH. A cold run builds the
images and takes tens of minutes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.kind, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[2]


def test_kind_e2e(tmp_path: Path) -> None:
    if shutil.which("kind") is None:
        pytest.skip("needs the kind binary on PATH (https://kind.sigs.k8s.io)")
    env = {
        **os.environ,
        "KIND_CLUSTER": f"dynamo-e2e-{uuid.uuid4().hex[:6]}",
        "DYNAMO_KIND_DIR": str(tmp_path),
    }
    script = str(REPO / "hack" / "kind-e2e")
    try:
        up = subprocess.run(
            [script, "up"], capture_output=True, text=True, env=env, check=False, timeout=3300
        )
        assert up.returncode == 0, f"hack/kind-e2e up failed:\n{up.stderr[-6000:]}"
        assert "tiny" in up.stdout  # `kubectl get dw,lora,pods` at the end
    finally:
        down = subprocess.run(
            [script, "down"], capture_output=True, text=True, env=env, check=False, timeout=300
        )
    assert down.returncode == 0, down.stderr
