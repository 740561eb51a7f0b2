"""docs/troubleshooting.md names every reason the operator writes, so it stays complete.

The reasons are collected from the source, not from a list kept by hand: every CamelCase
string literal that the reconcilers put where a reason goes (a `reason=` argument, a
`WantedCondition(type, status, REASON, ...)`, an assignment to or comparison with a `reason`, an
Event's reason), the reason tables of `pods.adapters` and `reconcile.loraadapter.reasons`,
the pod problems of `reconcile.dynamoworker.status`, and the per-pod adapter states.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from dynamo_operator.api.loraadapter import AdapterState
from dynamo_operator.pods import adapters
from dynamo_operator.reconcile.dynamoworker import status
from dynamo_operator.reconcile.loraadapter import reasons

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "troubleshooting.md"
OPERATOR = REPO / "operator" / "src" / "dynamo_operator"
# The modules that write conditions, per-pod adapter states and Events of our kinds.
SOURCES = (
    "reconcile/dynamoworker/status.py",
    "reconcile/dynamoworker/reconciler.py",
    "reconcile/loraadapter/plan.py",
    "reconcile/loraadapter/status.py",
    "reconcile/loraadapter/reconciler.py",
    "pods/adapters.py",
)
CAMEL = re.compile(r"^[A-Z][A-Za-z0-9]+$")


def _strings(node: ast.AST | None) -> set[str]:
    """CamelCase string constants an expression can evaluate to (through `or`, `x if c else y`,
    tuples)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} if CAMEL.match(node.value) else set()
    if isinstance(node, ast.BoolOp):
        return set().union(*(_strings(v) for v in node.values))
    if isinstance(node, ast.IfExp):
        return _strings(node.body) | _strings(node.orelse)
    if isinstance(node, ast.Tuple | ast.List):
        return set().union(*(_strings(e) for e in node.elts)) if node.elts else set()
    return set()


def _names_reason(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "reason") or (
        isinstance(node, ast.Attribute) and node.attr == "reason"
    )


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def reasons_in(source: str) -> set[str]:
    """The reasons written in one module's source."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg == "reason":
                    found |= _strings(keyword.value)
            if _callee(node) == "WantedCondition" and len(node.args) >= 3:
                found |= _strings(node.args[2])
            if _callee(node) == "_event" and len(node.args) >= 2:
                found |= _strings(node.args[1])
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_names_reason(t) for t in targets):
                found |= _strings(node.value)
        elif isinstance(node, ast.Compare) and _names_reason(node.left):
            for comparator in node.comparators:
                found |= _strings(comparator)
        elif isinstance(node, ast.BoolOp) and any(_names_reason(v) for v in node.values):
            found |= _strings(node)
    return found


def code_reasons() -> set[str]:
    """Every reason the operator can write, from the code."""
    found: set[str] = set()
    for name in SOURCES:
        found |= reasons_in((OPERATOR / name).read_text())
    found |= set(adapters.WORKER_REASONS.values()) | set(reasons.FIXES) | set(reasons.REASON_ORDER)
    found |= {reason for reason, _ in status._PROBLEM_REASONS.values()}
    found |= {adapters.CAPACITY_EXCEEDED, adapters.WORKER_UNREACHABLE, adapters.LORA_DISABLED}
    return found


def documented() -> set[str]:
    """Every CamelCase word the doc shows as code (`Reason`)."""
    return set(re.findall(r"`([A-Z][A-Za-z0-9]+)`", DOC.read_text()))


def test_the_collector_finds_reasons_of_every_kind() -> None:
    # A guard against a collector that silently finds nothing.
    reasons = code_reasons()
    for expected in (
        "AllReplicasReady",  # DynamoWorker Ready (WantedCondition)
        "InvalidSpec",  # reconciler.py reason= keyword
        "OOMKilled",  # pod problem table
        "NameConflict",  # LoRAAdapter conditions
        "BackingOff",  # per-pod reason (keyword)
        "NotLoaded",  # compared with result.reason
        "ListFailed",  # pods.adapters
        "Unloaded",  # Event reason
        "UnpinnedRevision",  # SourcePinned condition
        "DownloadTimeout",  # worker reason table
    ):
        assert expected in reasons
    assert len(reasons) > 50


def test_reasons_in_reads_each_place_a_reason_goes() -> None:
    source = (
        "a = OpResult(reason='FromKeyword')\n"
        "WantedCondition(t, 'True', 'FromWanted', 'm')\n"
        "reason = 'FromIf' if x else 'FromElse'\n"
        "if t.reason == 'FromCompare': pass\n"
        "r = y.reason or 'FromOr'\n"
        "self._event(state, 'FromEvent', 'note')\n"
        "other = 'NotAReason'\n"
    )
    assert reasons_in(source) == {
        "FromKeyword",
        "FromWanted",
        "FromIf",
        "FromElse",
        "FromCompare",
        "FromOr",
        "FromEvent",
    }


def test_every_reason_is_documented() -> None:
    missing = sorted(code_reasons() - documented())
    assert not missing, f"docs/troubleshooting.md lacks these reasons: {', '.join(missing)}"


def test_every_adapter_state_is_documented() -> None:
    missing = sorted(s.value for s in AdapterState if s.value not in documented())
    assert not missing, f"docs/troubleshooting.md lacks these adapter states: {missing}"
