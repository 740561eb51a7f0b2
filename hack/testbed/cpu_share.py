"""The control plane's CPU share: the bed reserves CPU for itself as a node does for the system
and for Kubernetes (`systemReserved`, `kubeReserved`).

Every process of the bed (etcd, the API server, the controller manager, the scheduler, kwok,
the service proxy, the volume provisioner, the kubelet API, the process node's agent, the
kubelet node's kubelet and containerd) runs in the cgroup `dynamo-testbed-system`, and the
process node's pods in `dynamo-testbed-pods` (the kubelet node's pods are already in the
kubelet's own cgroup root). The CPU weights are relative: the system group's is eight times the
pods' group's and eight times a default process's, so when engines saturate the cores the
control plane still gets most of what it asks for, and the pods share what is left. A weight
takes nothing from anyone while the control plane is idle.

Measured with `tests/bench/bench_control_plane_share.py` (docs/development/test-bed.md).

cgroup v1 (this host: the `cpu` controller's own hierarchy, `cpu.shares`, default 1024) and
cgroup v2 (`cpu.weight`, default 100, the controller enabled from the root) are both handled.
Where neither can be written (not root, a read-only /sys/fs/cgroup in a container) the bed runs
as before, with every process at the same weight: `available()` says why, and `up` prints it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

HIERARCHIES = Path("/sys/fs/cgroup")
# Eight times the default: see the module doc.
SYSTEM_WEIGHT_FACTOR = 8


@dataclass(frozen=True)
class CpuGroup:
    """One of the bed's cgroups: its name at the hierarchy's root, its weight relative to a
    default process (1: the same as one)."""

    name: str
    relative_weight: int


SYSTEM = CpuGroup("dynamo-testbed-system", SYSTEM_WEIGHT_FACTOR)
PODS = CpuGroup("dynamo-testbed-pods", 1)


def _v2() -> bool:
    return (HIERARCHIES / "cgroup.controllers").exists()


def _directory(group: CpuGroup) -> Path:
    return HIERARCHIES / group.name if _v2() else HIERARCHIES / "cpu" / group.name


def available() -> str | None:
    """None when the groups can be made, else why not (for the bed's own log)."""
    parent = HIERARCHIES if _v2() else HIERARCHIES / "cpu"
    if _v2() and "cpu" not in (HIERARCHIES / "cgroup.controllers").read_text().split():
        return "cgroup v2 without its cpu controller"
    if not (parent / "cgroup.procs").exists():
        return f"no cpu cgroup hierarchy at {parent}"
    try:
        _ensure(SYSTEM)
    except OSError as err:
        return f"cannot make a cgroup in {parent}: {err.strerror}"
    return None


def _ensure(group: CpuGroup) -> Path:
    directory = _directory(group)
    if _v2():
        control = HIERARCHIES / "cgroup.subtree_control"
        if "cpu" not in control.read_text().split():
            control.write_text("+cpu")
        directory.mkdir(exist_ok=True)
        (directory / "cpu.weight").write_text(str(100 * group.relative_weight))
    else:
        directory.mkdir(exist_ok=True)
        (directory / "cpu.shares").write_text(str(1024 * group.relative_weight))
    return directory


def place(pid: int, group: CpuGroup) -> bool:
    """Move process `pid` (all its threads; the children it forks later follow it) into
    `group`; whether it could. Best effort: a bed without the groups still runs.

    Called just after the spawn, not from a `preexec_fn` (unsafe in a process with threads, as
    the process node's agent is): the bed's processes exec at once and fork late, if at all
    (the kubelet node's supervisor starts containerd once it has read its settings, a pod's
    launcher execs its command once it has mounted its volumes)."""
    try:
        (_ensure(group) / "cgroup.procs").write_text(str(pid))
    except OSError:
        return False
    return True


def release(pid: int) -> None:
    """Move `pid` back to the hierarchy's root, one weight among all processes: the bed as it
    was before it had groups (the baseline of tests/bench/bench_control_plane_share.py)."""
    root = HIERARCHIES if _v2() else HIERARCHIES / "cpu"
    with contextlib.suppress(OSError):
        (root / "cgroup.procs").write_text(str(pid))


def remove() -> None:
    """Remove both groups once the bed is down (a group still holding a process stays)."""
    for group in (PODS, SYSTEM):
        with contextlib.suppress(OSError):
            _directory(group).rmdir()
