"""The chart's dashboards and alerts, rendered by the real helm binary: both off by default;
dashboards as ConfigMaps with Grafana's sidecar label (configurable); the PrometheusRule only
where the cluster serves its kind, holding exactly the rule file promtool tests, with
`runbook_url`s when a base URL is set; and the dashboards' variables and queries."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.helm import CHART, RENDER_KUBE_VERSION, documents, require_helm, run_helm, template
from support.prometheus import DASHBOARDS, RULES, dashboard_queries

pytestmark = pytest.mark.unit

PROMETHEUS_RULE_API = "monitoring.coreos.com/v1/PrometheusRule"
WORKER_SELECTOR = 'pod=~"$dynamoworker-[a-z0-9]+-[a-z0-9]+"'


@pytest.fixture(scope="module")
def helm() -> Path:
    return require_helm()


def kinds(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_both_are_off_by_default(helm: Path) -> None:
    docs = documents(template(helm, extra=["--api-versions", PROMETHEUS_RULE_API]).stdout)
    assert not kinds(docs, "PrometheusRule")
    assert not [d for d in kinds(docs, "ConfigMap") if "dashboard" in d["metadata"]["name"]]


def test_dashboards_are_configmaps_for_the_grafana_sidecar(helm: Path) -> None:
    docs = documents(template(helm, {"dashboards": {"enabled": True}}).stdout)
    maps = kinds(docs, "ConfigMap")
    assert len(maps) == len(DASHBOARDS) >= 1
    for path in DASHBOARDS:
        name = f"dynamo-operator-dashboard-{path.stem}"
        (found,) = [m for m in maps if m["metadata"]["name"] == name]
        assert found["metadata"]["namespace"] == "dynamo-system"
        assert found["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(found["data"][path.name]) == json.loads(path.read_text())


def test_dashboard_label_annotations_and_namespace_are_configurable(helm: Path) -> None:
    values = {
        "dashboards": {
            "enabled": True,
            # Helm merges maps: null drops the default label.
            "labels": {"dashboards": "dynamo", "grafana_dashboard": None},
            "annotations": {"grafana_folder": "Dynamo"},
            "namespace": "monitoring",
        }
    }
    (found,) = kinds(documents(template(helm, values).stdout), "ConfigMap")
    assert found["metadata"]["namespace"] == "monitoring"
    assert found["metadata"]["labels"]["dashboards"] == "dynamo"
    assert "grafana_dashboard" not in found["metadata"]["labels"]
    assert found["metadata"]["annotations"] == {"grafana_folder": "Dynamo"}


def test_the_prometheus_rule_needs_its_kind_in_the_cluster(helm: Path) -> None:
    docs = documents(template(helm, {"prometheusRule": {"enabled": True}}).stdout)
    assert not kinds(docs, "PrometheusRule")


def test_the_prometheus_rule_is_the_rule_file(helm: Path) -> None:
    values = {"prometheusRule": {"enabled": True, "labels": {"release": "kps"}}}
    docs = documents(template(helm, values, extra=["--api-versions", PROMETHEUS_RULE_API]).stdout)
    (rule,) = kinds(docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())


def test_a_runbook_base_url_adds_runbook_urls(helm: Path) -> None:
    base = "https://example.com/dynamo/docs/troubleshooting.md"
    values = {"prometheusRule": {"enabled": True, "runbookBaseUrl": base}}
    docs = documents(template(helm, values, extra=["--api-versions", PROMETHEUS_RULE_API]).stdout)
    (rule,) = kinds(docs, "PrometheusRule")
    alerts = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    assert alerts
    for alert in alerts:
        anchor = alert["annotations"]["runbook"].partition("#")[2]
        assert alert["annotations"]["runbook_url"] == f"{base}#{anchor}"


def test_lint_is_clean_with_both_on(helm: Path) -> None:
    values = {"dashboards": {"enabled": True}, "prometheusRule": {"enabled": True}}
    args = [a for k, v in values.items() for a in ("--set-json", f"{k}={json.dumps(v)}")]
    result = run_helm(
        helm, "lint", str(CHART), "--strict", "--kube-version", RENDER_KUBE_VERSION, *args
    )
    assert "0 chart(s) failed" in result.stdout, result.stdout
    assert "[WARNING]" not in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"dashboards": {"enabled": "yes"}}, "at '/dashboards/enabled': got string, want boolean"),
        ({"dashboards": {"label": {}}}, "additional properties 'label' not allowed"),
        ({"prometheusRule": {"runbookBaseUrl": "docs"}}, "at '/prometheusRule/runbookBaseUrl'"),
    ],
)
def test_the_schema_refuses_bad_values(helm: Path, values: dict[str, Any], message: str) -> None:
    result = template(helm, values, check=False)
    assert result.returncode != 0
    assert message in result.stderr


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_each_dashboard_has_namespace_and_dynamoworker_variables(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "dynamoworker"} <= set(variables)
    assert "$namespace" in variables["dynamoworker"]["definition"]
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"], f"{panel['title']}: no query"
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_every_worker_query_selects_the_variables() -> None:
    for query in dashboard_queries():
        if "dynamo_component_" in query.expr or "dynamo_worker_" in query.expr:
            assert 'namespace=~"$namespace"' in query.expr, query.panel
            assert WORKER_SELECTOR in query.expr, query.panel
