"""The process node's container logs for the kubelet API: CRI log records, and which run's
file `kubectl logs` reads with and without --previous."""

from __future__ import annotations

import sys

import pytest

from support.cluster import REPO

sys.path.insert(0, str(REPO / "hack"))
from testbed.container_logs import MAX_RECORD, records
from testbed.process_node import Container

pytestmark = pytest.mark.unit

NOW = b"2026-12-01T10:00:00.000001Z"


def test_cri_records_split_lines_and_keep_partial_ones() -> None:
    out, tail = records("stdout", b"", b"one\ntw", NOW)
    assert out == [NOW + b" stdout F one\n"]
    assert tail == b"tw"
    out, tail = records("stdout", tail, b"o\n", NOW)
    assert out == [NOW + b" stdout F two\n"]
    assert tail == b""
    long = b"x" * (MAX_RECORD + 5)
    out, tail = records("stderr", b"", long, NOW)
    assert out == [NOW + b" stderr P " + b"x" * MAX_RECORD + b"\n"]
    assert tail == b"x" * 5
    out, tail = records("stderr", tail, b"", NOW)  # end of stream: the rest as a partial record
    assert out == [NOW + b" stderr P xxxxx\n"]
    assert tail == b""


def test_log_files_follow_the_kubelets_choice() -> None:
    container = Container("main", {})
    assert container.log_numbers() == (-1, -2)  # never ran: no log, no previous
    container.run_number = 0
    assert container.log_numbers() == (0, -1)
    container.waiting_reason = "CrashLoopBackOff"  # run 0 exited, the restart waits
    assert container.log_numbers() == (0, 0)
    container.run_number, container.waiting_reason = 1, None
    assert container.log_numbers() == (1, 0)
