"""Each fault-matrix cell's verdict the moment it ends, and the matrix's tally at the end.

pytest's `-q` progress is a row of letters and its failure details come only when the whole
run ends, so a full matrix (most of an hour) stopped early said nothing of what failed.
"""

from __future__ import annotations

import pytest

CELL_TEST = "test_scenario_under_fault_keeps_the_invariants"


class FaultMatrixReport:
    """A pytest plugin: one line per cell that ran (its id, verdict, time and, on failure, the
    invariant's message), and `fault matrix: N cells ...` in the terminal summary."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.verdicts: dict[str, int] = {}
        self.seconds = 0.0  # the cells' own time (setup and call), not the session's

    def _write(self, line: str) -> None:
        terminal = self.config.pluginmanager.get_plugin("terminalreporter")
        if terminal is not None:
            terminal.write_line(line, flush=True)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if CELL_TEST not in report.nodeid or report.skipped:
            return
        self.seconds += report.duration
        # A setup error (a fixture) ends the cell as surely as a failed call does.
        if report.when == "setup" and report.passed:
            return
        if report.when != "call" and not report.failed:
            return
        cell = report.nodeid.rsplit("[", 1)[-1].rstrip("]")
        verdict = "passed" if report.passed else ("error" if report.when != "call" else "failed")
        self.verdicts[verdict] = self.verdicts.get(verdict, 0) + 1
        line = f"fault matrix: {cell} {verdict.upper()} in {report.duration:.0f}s"
        if report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message if crash is not None else str(report.longrepr)
            line += "\n    " + "\n    ".join(message.splitlines()[:12])
        self._write(line)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.verdicts:
            return
        tally = ", ".join(f"{n} {verdict}" for verdict, n in sorted(self.verdicts.items()))
        cells = sum(self.verdicts.values())
        terminalreporter.write_line(
            f"fault matrix: {cells} cells ({tally}) in {self.seconds / 60:.1f} min"
        )
