"""The operator image installs what the operator imports and nothing more.

The image installs the base dependencies and the `operator` extra (operator/Dockerfile, through
hack/pyproject-requirements), then the project itself with --no-deps. Two checks that each
would fail if an operator module came to import a worker package such as av or torch:
- by reading the source: every third-party module a `dynamo_operator` module imports is
  provided by a distribution the set names, and every distribution the set names is
  imported (none is there for nothing); none of the worker's or the engine's packages is;
- by importing: a fresh interpreter imports every `dynamo_operator` module, and every module
  that ends up loaded comes from the set's distributions or what they depend on, never from
  the worker runtime (`dynamo`) or a worker-only package.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from support.dockerfile import parse

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OPERATOR_SOURCE = ROOT / "operator" / "src" / "dynamo_operator"
OWN = {"dynamo_operator", "dynamo", "__future__"}


def requirements(extra: str | None) -> list[Requirement]:
    """The base dependencies (extra None) or one extra's."""
    listed = PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]
    return [Requirement(r) for r in listed]


def names(reqs: list[Requirement]) -> set[str]:
    return {canonicalize_name(r.name) for r in reqs}


OPERATOR_SET = names(requirements(None) + requirements("operator"))
WORKER_ONLY = (names(requirements("worker")) | names(requirements("engine"))) - OPERATOR_SET


def distributions_of(module: str) -> set[str]:
    """The installed distributions that provide the top-level module `module`."""
    return {canonicalize_name(d) for d in md.packages_distributions().get(module, [])}


def imported_modules(root: Path) -> dict[str, set[str]]:
    """Third-party top-level modules imported anywhere under `root`, with the files."""
    found: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.partition(".")[0]
                if top not in sys.stdlib_module_names and top not in OWN:
                    found.setdefault(top, set()).add(path.relative_to(ROOT).as_posix())
    return found


def closure(reqs: list[Requirement]) -> set[str]:
    """The distributions `reqs` install: them and, transitively, what they require (with the
    extras asked for), as far as this environment has them installed."""
    seen: set[tuple[str, frozenset[str]]] = set()
    out: set[str] = set()
    stack = [(r.name, frozenset(r.extras)) for r in reqs]
    while stack:
        name, extras = stack.pop()
        if (canonicalize_name(name), extras) in seen:
            continue
        seen.add((canonicalize_name(name), extras))
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # not installed here, so nothing can have been imported from it
        out.add(canonicalize_name(name))
        for line in dist.requires or []:
            req = Requirement(line)
            wanted = extras or frozenset({""})
            if req.marker is not None and not any(
                req.marker.evaluate({"extra": e}) for e in wanted
            ):
                continue
            stack.append((req.name, frozenset(req.extras)))
    return out


def image_requirements(dockerfile: str) -> list[str]:
    """The extras each `hack/pyproject-requirements EXTRA...` call of the Dockerfile names."""
    _, stages = parse((ROOT / dockerfile).read_text())
    runs = " ".join(run for stage in stages for run in stage.values("RUN"))
    return re.findall(r"/tmp/build/requirements ([a-z ]+?)\s*>", runs)


def test_the_operator_image_installs_the_operator_extra() -> None:
    assert image_requirements("operator/Dockerfile") == ["operator"]


def test_the_worker_image_installs_the_worker_and_engine_extras() -> None:
    assert image_requirements("worker_image/Dockerfile") == ["worker engine"]


def test_the_operator_set_is_exactly_what_the_operator_imports() -> None:
    imported = imported_modules(OPERATOR_SOURCE)
    provided: set[str] = set()
    for module, files in sorted(imported.items()):
        dists = distributions_of(module)
        assert dists & OPERATOR_SET, (
            f"{', '.join(sorted(files))} import(s) {module}, which the operator image does not "
            f"install (provided by {sorted(dists) or 'nothing installed'}): add it to the "
            "`operator` extra in pyproject.toml, or keep the import out of dynamo_operator"
        )
        provided |= dists & OPERATOR_SET
    assert provided == OPERATOR_SET, (
        f"installed for nothing (no dynamo_operator module imports them): "
        f"{sorted(OPERATOR_SET - provided)}"
    )
    assert not OPERATOR_SET & WORKER_ONLY
    # The walk sees the operator's real imports (a guard against one that finds nothing).
    assert {"kopf", "kubernetes_asyncio", "pydantic"} <= set(imported)


# Prints the top-level modules loaded from files outside the standard library (synthetic
# modules such as Cython's `cython_runtime` have no file; `_sysconfigdata_*` is the stdlib's).
LOADED = """
import json, sys, sysconfig
stdlib = tuple(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib"))
files = {n.partition(".")[0]: getattr(m, "__file__", None) for n, m in list(sys.modules.items())}
print(json.dumps(sorted(
    n for n, f in files.items()
    if f and ("site-packages" in f or not f.startswith(stdlib))
)))
"""


def loaded_after(script: str) -> set[str]:
    """The top-level modules from outside the standard library that a fresh interpreter
    holds after running `script`."""
    done = subprocess.run(
        [sys.executable, "-c", script + LOADED], capture_output=True, text=True, check=True
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_importing_the_whole_operator_loads_nothing_beyond_its_set() -> None:
    everything = (
        "import importlib, pkgutil\n"
        "import dynamo_operator\n"
        "for m in pkgutil.walk_packages(dynamo_operator.__path__, 'dynamo_operator.'):\n"
        "    importlib.import_module(m.name)\n"
    )
    # What the interpreter and this environment's site hooks load on their own.
    baseline = loaded_after("")
    loaded = loaded_after(everything) - baseline
    assert "dynamo_operator" in loaded
    assert "dynamo" not in loaded, "an operator module imports the worker runtime"
    allowed = closure(requirements(None) + requirements("operator"))
    strays = {}
    for module in sorted(loaded - OWN):
        dists = distributions_of(module)
        if not dists & allowed:
            strays[module] = sorted(dists)
    assert not strays, f"modules loaded from outside the operator's install set: {strays}"
    assert not {d for m in loaded for d in distributions_of(m)} & WORKER_ONLY
