"""The test tree itself: pytest imports test modules by basename (rootdir-relative, no
packages), so two modules with one name in different tiers fail at collection, and only
when both tiers are collected together, as in CI."""

from collections import Counter
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.unit


def test_every_test_module_basename_is_unique_across_tiers() -> None:
    modules = [p for p in TESTS.rglob("*.py") if p.name.startswith(("test_", "bench_"))]
    counts = Counter(p.name for p in modules)
    clashes = {
        name: sorted(str(p.relative_to(TESTS)) for p in modules if p.name == name)
        for name, n in counts.items()
        if n > 1
    }
    assert not clashes, f"rename one of each: {clashes}"
