"""kubectl against the test bed, for the tests of what the process node's kubelet API serves
(logs, exec, port-forward): argv for long-running commands, and a run with stdin."""

from __future__ import annotations

import subprocess

from support.cluster import Cluster


def kubectl_argv(cluster: Cluster, *args: str) -> list[str]:
    binary = str(cluster.bin_dir / "kubectl") if cluster.bin_dir else "kubectl"
    return [binary, f"--kubeconfig={cluster.kubeconfig}", *args]


def kubectl(
    cluster: Cluster, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run kubectl to completion (exit code not checked: tests assert on it)."""
    return subprocess.run(
        kubectl_argv(cluster, *args),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
