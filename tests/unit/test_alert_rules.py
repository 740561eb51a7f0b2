"""The chart's alerts, checked by the real promtool: the rule file is valid (`promtool check
rules`), each alert fires on the series that should fire it and not on the others
(`promtool test rules` on tests/unit/data/alerts.test.yaml, which must cover every alert both
ways), each alert's runbook is a section of docs/troubleshooting.md, and every operator metric
the rules and dashboards read is one the operator exports. (The worker metrics are checked
against a live scrape in tests/e2e/test_observability.py.)
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from dynamo_operator.metrics import OperatorMetrics
from support.prometheus import RULES, alert_rules, dashboard_queries, require_promtool

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).parent / "data" / "alerts.test.yaml"
TROUBLESHOOTING = REPO / "docs" / "troubleshooting.md"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
OPERATOR_METRIC = re.compile(r"\bdynamo_operator_[a-z_]+\b")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(require_promtool()), *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}{result.stderr}"
    return result


def test_promtool_check_rules_passes() -> None:
    result = promtool("check", "rules", str(RULES))
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    promtool("test", "rules", str(TESTS))


def test_every_alert_is_tested_firing_and_silent() -> None:
    cases = yaml.safe_load(TESTS.read_text())["tests"]
    checks = [check for case in cases for check in case["alert_rule_test"]]
    for rule in alert_rules():
        mine = [check for check in checks if check["alertname"] == rule["alert"]]
        assert any(check["exp_alerts"] for check in mine), f"{rule['alert']}: never fires"
        assert any(not check["exp_alerts"] for check in mine), f"{rule['alert']}: never silent"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_runbook_is_a_troubleshooting_section() -> None:
    headings = {
        github_anchor(line.lstrip("#"))
        for line in TROUBLESHOOTING.read_text().splitlines()
        if line.startswith("#")
    }
    for rule in alert_rules():
        path, _, anchor = rule["annotations"]["runbook"].partition("#")
        assert path == "docs/troubleshooting.md", rule["alert"]
        assert anchor in headings, f"{rule['alert']}: no section #{anchor} in {path}"


def exported_operator_series() -> set[str]:
    """Every series name the operator's registry can expose."""
    names: set[str] = set()
    for family in text_string_to_metric_families(OperatorMetrics().exposition().decode()):
        names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def test_rules_and_dashboards_read_only_metrics_the_operator_exports() -> None:
    exported = exported_operator_series()
    exprs = [rule["expr"] for rule in alert_rules()] + [q.expr for q in dashboard_queries()]
    used = {name for expr in exprs for name in OPERATOR_METRIC.findall(expr)}
    assert used, "the rules and dashboards read no operator metric"
    assert used <= exported, f"not exported by the operator: {sorted(used - exported)}"
