"""The activator imports `dynamo.runtime` and `dynamo.common`, never `dynamo.engines`."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import dynamo.activator

pytestmark = pytest.mark.unit

PACKAGE = Path(dynamo.activator.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports (absolute names; relative imports resolved)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = "dynamo.activator"
                found.add(f"{base}.{node.module}" if node.module else base)
            elif node.module:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_no_module_of_the_package_imports_the_engines() -> None:
    files = sorted(PACKAGE.glob("*.py"))
    assert len(files) > 10
    dynamo_imports = {
        (path.name, name)
        for path in files
        for name in imported_modules(path)
        if name.startswith("dynamo.")
    }
    assert any(name.startswith("dynamo.runtime") for _, name in dynamo_imports)
    offenders = [
        (file, name)
        for file, name in dynamo_imports
        if not name.startswith(("dynamo.activator", "dynamo.runtime", "dynamo.common"))
    ]
    assert offenders == []


def test_the_walk_sees_an_engine_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from dynamo.engines import sample\nimport dynamo.engines.vllm\n")
    assert {"dynamo.engines", "dynamo.engines.vllm"} <= imported_modules(probe)


def test_running_the_command_loads_no_engine() -> None:
    code = (
        "import sys, dynamo.activator.cli;"
        "print(sorted(m for m in sys.modules if m.startswith('dynamo.engines')))"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "[]"
