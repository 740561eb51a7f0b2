"""The process node's one exception to ignoring images: the vLLM worker image runs in vLLM's
venv, the same one the tests find (hack/vllm-venv's folder, or $DYNAMO_VLLM_VENV)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from support import vllm
from support.cluster import REPO

sys.path.insert(0, str(REPO / "hack"))
from testbed.layout import VLLM_VENV_ENV, VLLM_WORKER_IMAGE, image_venvs

pytestmark = pytest.mark.unit


def test_the_vllm_image_runs_in_the_venv_the_tests_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VLLM_VENV_ENV, raising=False)
    assert image_venvs() == {VLLM_WORKER_IMAGE: vllm.DEFAULT_VLLM_VENV}
    monkeypatch.setenv(VLLM_VENV_ENV, "/opt/vllm-venv")
    assert image_venvs() == {VLLM_WORKER_IMAGE: Path("/opt/vllm-venv")}
    assert vllm.vllm_venv() == Path("/opt/vllm-venv")
