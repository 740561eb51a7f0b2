"""hack/testtimes.py: the table `hack/test` ends with, from the files that fill up as it runs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "hack" / "testtimes.py"

pytestmark = pytest.mark.unit


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("testtimes", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["testtimes"] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


testtimes = _module()

STEPS = "the project's venv (.venv)\t12\n(in the background) the images\t400\npytest\t900\ntorn"
PHASES = "\n".join(
    [
        "fixture:node_images\tsetup\t190.5\t-",
        "fixture:api\tsetup\t0.2\t-",
        "tests/unit/test_a.py::test_one\tsetup\t0.1\tpassed",
        "tests/unit/test_a.py::test_one\tcall\t2.0\tpassed",
        "tests/unit/test_a.py::test_one\tteardown\t0.1\tpassed",
        "tests/e2e/test_b.py::test_two[x]\tsetup\t200.0\tpassed",
        "tests/e2e/test_b.py::test_two[x]\tcall\t30.0\tfailed",
        "tests/e2e/test_b.py::test_skip\tsetup\t0.0\tskipped",
        "tests/e2e/test_b.py::test_cut\tcall\t1",  # torn: pytest was killed mid-write
    ]
)


def _report() -> str:
    steps = testtimes.read_steps(STEPS.splitlines())
    phases = testtimes.read_phases(PHASES.splitlines())
    return str(testtimes.table(steps, phases, slowest=2))


def test_steps_total_leaves_out_what_ran_in_the_background() -> None:
    report = _report()
    assert "| (in the background) the images | 400 |" in report
    assert "| **total** | **912** |" in report


def test_session_fixtures_listed_once_and_quick_ones_left_out() -> None:
    report = _report()
    assert "| node_images | 190 |" in report
    assert "| api |" not in report


def test_directories_sum_every_phase_and_count_outcomes() -> None:
    report = _report()
    assert "| tests/unit | 2 | 1 passed |" in report
    assert "| tests/e2e | 230 | 1 failed, 1 skipped |" in report


def test_slowest_tests_add_their_phases_and_stop_at_the_limit() -> None:
    report = _report()
    slowest = report.split("slowest tests")[1]
    assert "| `tests/e2e/test_b.py::test_two[x]` | 230 |" in slowest
    assert "| `tests/unit/test_a.py::test_one` | 2 |" in slowest
    assert "test_skip" not in slowest


def test_missing_files_still_print_a_table(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "none.tsv"), str(tmp_path / "none2.tsv")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.startswith("| setup step | seconds |")
