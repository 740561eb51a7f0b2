"""The test bed's CPU groups (hack/testbed/cpu_share.py) on a fake cgroup tree of each kind:
the control plane's group weighs eight times the pods' group, and a bed that cannot make them
says why and still runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from support.cluster import REPO

sys.path.insert(0, str(REPO / "hack"))
from testbed import cpu_share

pytestmark = pytest.mark.unit


@pytest.fixture
def v1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The layout of this host: each controller its own hierarchy."""
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cgroup.procs").write_text("")
    monkeypatch.setattr(cpu_share, "HIERARCHIES", tmp_path)
    return tmp_path / "cpu"


@pytest.fixture
def v2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The unified hierarchy, the cpu controller not yet enabled for the root's children."""
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("memory\n")
    (tmp_path / "cgroup.procs").write_text("")
    monkeypatch.setattr(cpu_share, "HIERARCHIES", tmp_path)
    return tmp_path


def test_v1_groups_weigh_by_cpu_shares(v1: Path) -> None:
    assert cpu_share.available() is None
    assert cpu_share.place(1234, cpu_share.SYSTEM)
    assert cpu_share.place(5678, cpu_share.PODS)
    assert (v1 / "dynamo-testbed-system" / "cpu.shares").read_text() == "8192"
    assert (v1 / "dynamo-testbed-pods" / "cpu.shares").read_text() == "1024"
    assert (v1 / "dynamo-testbed-system" / "cgroup.procs").read_text() == "1234"
    assert (v1 / "dynamo-testbed-pods" / "cgroup.procs").read_text() == "5678"


def test_v2_enables_the_cpu_controller_and_weighs_by_cpu_weight(v2: Path) -> None:
    assert cpu_share.available() is None
    assert cpu_share.place(1234, cpu_share.SYSTEM)
    assert (v2 / "cgroup.subtree_control").read_text() == "+cpu"
    assert (v2 / "dynamo-testbed-system" / "cpu.weight").read_text() == "800"
    assert cpu_share.place(5678, cpu_share.PODS)
    assert (v2 / "dynamo-testbed-pods" / "cpu.weight").read_text() == "100"


def test_v2_without_its_cpu_controller_is_named(v2: Path) -> None:
    (v2 / "cgroup.controllers").write_text("memory pids\n")
    assert cpu_share.available() == "cgroup v2 without its cpu controller"


def test_no_hierarchy_is_named_and_placing_is_a_no_op(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_share, "HIERARCHIES", tmp_path / "none")
    assert "no cpu cgroup hierarchy" in (cpu_share.available() or "")
    assert not cpu_share.place(1234, cpu_share.PODS)


def test_remove_leaves_a_group_that_still_holds_a_process(v1: Path) -> None:
    cpu_share.place(1234, cpu_share.SYSTEM)
    cpu_share.place(5678, cpu_share.PODS)
    (v1 / "dynamo-testbed-pods" / "cpu.shares").unlink()  # empty, as the kernel's would be
    (v1 / "dynamo-testbed-pods" / "cgroup.procs").unlink()
    cpu_share.remove()
    assert not (v1 / "dynamo-testbed-pods").exists()
    assert (v1 / "dynamo-testbed-system").exists()


def test_release_moves_a_process_back_to_the_root(v1: Path) -> None:
    cpu_share.place(1234, cpu_share.SYSTEM)
    cpu_share.release(1234)
    assert (v1 / "cgroup.procs").read_text() == "1234"
