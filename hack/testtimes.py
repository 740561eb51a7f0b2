"""Where `hack/test`'s time went: the table it prints at its end, passed or failed.

`python hack/testtimes.py STEPS PHASES` reads two tab-separated files that fill up as the run
goes, so a failed or killed run still has what it finished:

- STEPS (written by `hack/test`): `name<TAB>seconds`, one line per setup step (venvs, builds,
  images, lint, pytest itself); a step whose name begins with `(in the background)` ran beside
  the others and is left out of the total;
- PHASES (written by `tests/conftest.py` when `DYNAMO_TEST_PHASES` names it): one line per
  test phase, `nodeid<TAB>phase<TAB>seconds<TAB>outcome` with phase `setup`, `call` or
  `teardown`, and one per session fixture set up, `fixture:NAME<TAB>setup<TAB>seconds<TAB>-`
  (the kubelet node's image imports, the test bed, Prometheus: whatever a fixture does once).

It prints Markdown: the steps, the session fixtures, pytest's seconds per test directory (a
fixture's setup is counted in the directory of the test that first asked for it), and the
slowest tests (all three phases together). `docs/development/testing.md` holds a copy from a
cold and from a warm run.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

SLOWEST = 30
FIXTURE_PREFIX = "fixture:"
BACKGROUND = "(in the background)"
# Session fixtures quicker than this (API clients, paths) would only lengthen the table.
FIXTURE_SHOWN_FROM_SECONDS = 1.0


@dataclass(frozen=True)
class Phase:
    """One line of PHASES."""

    nodeid: str
    when: str
    seconds: float
    outcome: str


def read_steps(lines: Iterable[str]) -> list[tuple[str, float]]:
    """`name<TAB>seconds` lines, in order; blank or torn lines (a killed writer) skipped."""
    steps = []
    for line in lines:
        name, _, seconds = line.rstrip("\n").rpartition("\t")
        try:
            steps.append((name, float(seconds)))
        except ValueError:
            continue
    return steps


def read_phases(lines: Iterable[str]) -> list[Phase]:
    """PHASES' lines; torn ones (a killed writer) skipped."""
    phases = []
    for line in lines:
        fields = line.rstrip("\n").split("\t")
        if len(fields) != 4:
            continue
        try:
            phases.append(Phase(fields[0], fields[1], float(fields[2]), fields[3]))
        except ValueError:
            continue
    return phases


def directory_of(nodeid: str) -> str:
    """The test directory of a node id (`tests/unit/test_x.py::test_y` -> `tests/unit`)."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else path


def table(steps: list[tuple[str, float]], phases: list[Phase], slowest: int = SLOWEST) -> str:
    """The Markdown report (see the module doc)."""
    out = ["| setup step | seconds |", "| --- | ---: |"]
    out += [f"| {name} | {seconds:.0f} |" for name, seconds in steps]
    total = sum(seconds for name, seconds in steps if not name.startswith(BACKGROUND))
    out.append(f"| **total** | **{total:.0f}** |")

    fixtures = [
        p
        for p in phases
        if p.nodeid.startswith(FIXTURE_PREFIX) and p.seconds >= FIXTURE_SHOWN_FROM_SECONDS
    ]
    tests = [p for p in phases if not p.nodeid.startswith(FIXTURE_PREFIX)]
    if fixtures:
        out += ["", "| session fixture (set up once) | seconds |", "| --- | ---: |"]
        ordered = sorted(fixtures, key=lambda p: -p.seconds)
        out += [f"| {p.nodeid.removeprefix(FIXTURE_PREFIX)} | {p.seconds:.0f} |" for p in ordered]

    per_dir: dict[str, float] = defaultdict(float)
    per_test: dict[str, float] = defaultdict(float)
    outcomes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for p in tests:
        per_dir[directory_of(p.nodeid)] += p.seconds
        per_test[p.nodeid] += p.seconds
        # A test's outcome is its call's; a setup that failed or skipped has no call.
        if p.when == "call" or p.outcome != "passed":
            outcomes[directory_of(p.nodeid)][p.outcome] += 1
    if per_dir:
        out += ["", "| pytest directory | seconds | outcomes |", "| --- | ---: | --- |"]
        for directory in sorted(per_dir):
            counts = ", ".join(f"{n} {o}" for o, n in sorted(outcomes[directory].items()))
            out.append(f"| {directory} | {per_dir[directory]:.0f} | {counts} |")
        out.append(f"| **total** | **{sum(per_dir.values()):.0f}** | |")
        out += ["", f"| {slowest} slowest tests (setup + call + teardown) | seconds |"]
        out.append("| --- | ---: |")
        ranked = sorted(per_test.items(), key=lambda item: -item[1])[:slowest]
        out += [f"| `{nodeid}` | {seconds:.0f} |" for nodeid, seconds in ranked]
    return "\n".join(out)


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit("usage: testtimes.py STEPS PHASES")
    steps_path, phases_path = (Path(a) for a in argv)
    print(table(read_steps(_lines(steps_path)), read_phases(_lines(phases_path))))


if __name__ == "__main__":
    main(sys.argv[1:])
