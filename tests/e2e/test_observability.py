"""The chart's dashboards and alerts against a real Prometheus scraping the test bed.

Prometheus (built by hack/build-prometheus) runs on the host and finds its targets through
Kubernetes service discovery against the test bed's API server, with the scrape config the
chart documents for annotation-based scraping: worker pods by the `prometheus.io/*`
annotations the operator puts on them (spec.metrics.podMonitor Auto, no PodMonitor CRD), the
operator through a Service annotated the same way (the chart's `metrics.service.annotations`)
whose endpoint is the operator's metrics port on the pod network's gateway (the operator runs
as a host process here; the pods reach the host at that address too). It scrapes over the
pod network every second and evaluates the chart's rule file as it ships.

The test drives what the panels show: completions from the base model and an adapter, one
request for an unknown model (an error), one adapter that loads and one whose source does not
exist (load failures, Degraded); the worker is autoscaled within 1..1 so that the autoscaler
exports its load. Then every dashboard query must return data, and every alert
expression must evaluate, with each series it selects present, and every rule must be healthy.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from kubernetes_asyncio import client

from support.cluster import REPO, Cluster, eventually
from support.operator_namespace import (
    TRANSFORMERS_ENGINE,
    OperatorNamespace,
    operator_namespace,
    serving_worker_spec,
)
from support.operator_process import free_port
from support.prometheus import (
    RULES,
    PrometheusServer,
    alert_rules,
    dashboard_queries,
    prometheus_server,
    require_prometheus,
    substitute,
)
from support.tiny_model import TinyModel

sys.path.insert(0, str(REPO / "hack"))
from testbed.layout import GATEWAY_IP

pytestmark = pytest.mark.e2e

WORKER = "tiny"
ADAPTER, BROKEN = "sql", "missing"
OPERATOR_SERVICE = "dynamo-operator-metrics"
SCRAPE_ANNOTATIONS = ("prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path")
# A window that covers the whole test, so rates and increases see every sample scraped.
RATE_INTERVAL = "5m"
# Families the worker declares with no sample here, and why. Their queries must still name a
# family the scrape declares (its # TYPE line, in Prometheus's target metadata).
DECLARED_ONLY = {
    "dynamo_component_kv_cache_hit_rate": "no engine of this project has a prefix cache, so "
    "none measures a hit rate (ComponentSnapshot.kv_cache_hit_rate stays None)",
}
LABEL_VALUES = re.compile(r"label_values\((.+), *(\w+)\)")


def annotation(name: str) -> str:
    """A `prometheus.io/...` annotation as Kubernetes service discovery names its label."""
    return name.replace(".", "_").replace("/", "_")


def annotation_relabeling(role: str) -> list[dict[str, Any]]:
    """Keep the targets of `role` (pod, service) annotated for scraping; take their port and
    path from the annotations (the usual kubernetes-pods / kubernetes-service-endpoints jobs)."""
    scrape, port, path = (
        f"__meta_kubernetes_{role}_annotation_{annotation(a)}" for a in SCRAPE_ANNOTATIONS
    )
    return [
        {"source_labels": [scrape], "action": "keep", "regex": "true"},
        {"source_labels": [path], "target_label": "__metrics_path__", "regex": "(.+)"},
        {"source_labels": ["__address__", port], "target_label": "__address__",
         "regex": "([^:]+)(?::\\d+)?;(\\d+)", "replacement": "$1:$2"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
    ]  # fmt: skip


def scrape_config(kubeconfig: Path, namespace: str) -> dict[str, Any]:
    """prometheus.yml: worker pods and the operator by their prometheus.io annotations."""
    sd = {"kubeconfig_file": str(kubeconfig), "namespaces": {"names": [namespace]}}
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "kubernetes-pods",
                "kubernetes_sd_configs": [{"role": "pod", **sd}],
                "relabel_configs": [
                    *annotation_relabeling("pod"),
                    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                ],
            },
            {
                "job_name": "kubernetes-service-endpoints",
                # The operator's per-object series carry the object's namespace.
                "honor_labels": True,
                "kubernetes_sd_configs": [{"role": "endpointslice", **sd}],
                "relabel_configs": [
                    *annotation_relabeling("service"),
                    {
                        "source_labels": ["__meta_kubernetes_service_name"],
                        "target_label": "service",
                    },
                ],
            },
        ],
    }


@dataclass
class Bed:
    space: OperatorNamespace
    prometheus: PrometheusServer
    pod_ip: str


async def post(url: str, body: dict[str, Any]) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=30)) as response,
    ):
        await response.read()
        return response.status


async def expose_operator(space: OperatorNamespace) -> None:
    """A Service annotated for scraping whose endpoint is the operator's metrics port on the
    gateway address (the operator listens on every interface)."""
    port = space.operator.metrics_port
    service: Any = {
        "metadata": {
            "name": OPERATOR_SERVICE,
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(port),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": {"ports": [{"name": "metrics", "port": port, "targetPort": port}]},
    }
    await space.core.create_namespaced_service(space.namespace, service)
    endpoints: Any = {
        "metadata": {
            "name": OPERATOR_SERVICE,
            "labels": {"kubernetes.io/service-name": OPERATOR_SERVICE},
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [GATEWAY_IP], "conditions": {"ready": True}}],
        "ports": [{"name": "metrics", "port": port, "protocol": "TCP"}],
    }
    await client.DiscoveryV1Api(space.api).create_namespaced_endpoint_slice(
        space.namespace, endpoints
    )


async def adapter_state(space: OperatorNamespace, name: str) -> list[str]:
    found: Any = await space.custom.get_namespaced_custom_object(
        "dynamo.dev", "v1alpha1", space.namespace, "loraadapters", name
    )
    return [pod.get("state", "") for pod in (found.get("status") or {}).get("pods", [])]


@pytest_asyncio.fixture(scope="module")
async def bed(
    api: client.ApiClient,
    testbed: Cluster,
    tiny_model: TinyModel,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Bed]:
    require_prometheus()
    workdir = tmp_path_factory.mktemp("observability")
    async with operator_namespace(api, testbed, "t-obs", workdir) as space:
        shutil.copytree(tiny_model.base, space.shared / "base")
        shutil.copytree(tiny_model.adapters["sql-lora"], space.shared / "sql-lora")
        worker: Any = {
            "apiVersion": "dynamo.dev/v1alpha1",
            "kind": "DynamoWorker",
            "metadata": {"name": WORKER},
            "spec": {
                **serving_worker_spec(
                    space.shared / "base", 1, engine=TRANSFORMERS_ENGINE, max_loras=2
                ),
                # So that drive_traffic can have a request refused by the budget.
                "tokenBudget": {"combinedLimit": 64, "rejectTotalOverflow": True},
                # The autoscaler panels' series: the autoscaler reads this worker's load
                # and exports it, with bounds that keep its one pod.
                "autoscaling": {"minReplicas": 1, "maxReplicas": 1, "targetInFlightPerPod": 4},
            },
        }
        await space.create("dynamoworkers", worker)
        await expose_operator(space)
        with prometheus_server(scrape_config(testbed.kubeconfig, space.namespace), workdir,
                               free_port()) as prometheus:  # fmt: skip
            pods = await space.eventually(
                "a ready worker pod",
                lambda: space.core.list_namespaced_pod(
                    space.namespace, label_selector=f"dynamo.dev/worker={WORKER}"
                ),
                within=120,
                until=lambda found: (
                    len(found.items) == 1
                    and any(
                        c.type == "Ready" and c.status == "True"
                        for c in found.items[0].status.conditions or []
                    )
                ),
            )
            pod = pods.items[0]
            missing = [a for a in SCRAPE_ANNOTATIONS if a not in (pod.metadata.annotations or {})]
            assert not missing, (
                f"the worker pod lacks {missing}: a PodMonitor CRD in the test bed turns "
                "spec.metrics.podMonitor Auto into a PodMonitor"
            )
            yield Bed(space, prometheus, pod.status.pod_ip)


async def drive_traffic(bed: Bed) -> None:
    space = bed.space
    for name, uri in ((ADAPTER, f"file://{space.shared / 'sql-lora'}"),
                      (BROKEN, f"file://{space.shared / 'no-such-adapter'}")):  # fmt: skip
        body: Any = {
            "apiVersion": "dynamo.dev/v1alpha1",
            "kind": "LoRAAdapter",
            "metadata": {"name": name},
            "spec": {"workerRef": {"name": WORKER}, "source": {"uri": uri}},
        }
        await space.create("loraadapters", body)
    await space.eventually(
        f"{ADAPTER} loaded", lambda: adapter_state(space, ADAPTER), 60, lambda s: s == ["Loaded"]
    )
    url = f"http://{bed.pod_ip}:8000/v1/completions"
    for model in ("tiny-llama", ADAPTER, "tiny-llama", ADAPTER):
        body = {"model": model, "prompt": "the quick brown", "max_tokens": 4}
        assert await post(url, body) == 200
    assert await post(url, {"model": "no-such-model", "prompt": "x", "max_tokens": 1}) >= 400
    # Over the token budget: refused, counted by model and adapter.
    assert await post(url, {"model": ADAPTER, "prompt": "x", "max_tokens": 100}) == 400
    # No drain is driven here (the pod would be gone before a scrape saw its count):
    # dynamo_worker_drain_timeouts_exceeded_total has data as its declared 0, and the
    # count itself is tested in tests/unit/test_runtime_lifecycle.py.


def selectors(node: Any) -> list[str]:
    """The series selectors of a parsed PromQL expression (/api/v1/parse_query's tree)."""
    if isinstance(node, list):
        return [s for item in node for s in selectors(item)]
    if not isinstance(node, dict):
        return []
    if node.get("type") in ("vectorSelector", "matrixSelector"):
        matchers = ", ".join(
            f"{m['name']}{m['type']}{json.dumps(m['value'])}"
            for m in node["matchers"]
            if m["name"] != "__name__"
        )
        return [f"{node['name']}{{{matchers}}}"]
    return [s for value in node.values() for s in selectors(value)]


def promql(expr: str) -> str:
    """A dashboard query as PromQL: a variable's `label_values(SELECTOR, LABEL)` (Grafana's
    function) becomes the series of SELECTOR that carry LABEL."""
    found = LABEL_VALUES.fullmatch(expr)
    return f"group by ({found.group(2)}) ({found.group(1)})" if found else expr


async def test_every_dashboard_query_and_alert_expression_has_data(bed: Bed) -> None:
    await drive_traffic(bed)
    prometheus = bed.prometheus
    values = {
        "namespace": bed.space.namespace,
        "dynamoworker": WORKER,
        "__rate_interval": RATE_INTERVAL,
    }
    queries = {
        f"{q.panel}: {q.expr}": promql(substitute(q.expr, values)) for q in dashboard_queries()
    }
    for rule in alert_rules():
        tree = prometheus.api("parse_query", query=rule["expr"])
        for selector in selectors(tree):
            queries[f"{rule['alert']} selects {selector}"] = selector
    declared_only = {w: e for w, e in queries.items() if any(m in e for m in DECLARED_ONLY)}
    empty = {w: e for w, e in queries.items() if w not in declared_only}

    async def still_empty() -> dict[str, str]:
        for what, expr in list(empty.items()):
            if prometheus.query(expr):
                del empty[what]
        return empty

    try:
        await eventually(still_empty, 60, lambda left: not left, every=1.0)
    except AssertionError:
        targets = prometheus.api("targets")["activeTargets"]
        health = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in targets]
        raise AssertionError(
            f"no data for {sorted(empty)}\ntargets: {health}\n{prometheus.log_tail()}"
        ) from None

    for what, expr in declared_only.items():
        assert prometheus.query(expr) == [], f"{what} has data now: drop it from DECLARED_ONLY"
        for metric in (m for m in DECLARED_ONLY if m in expr):
            declared = prometheus.api("targets/metadata", metric=metric)
            assert any(d["target"].get("namespace") == bed.space.namespace for d in declared), (
                f"{metric} is not declared by the scraped workers"
            )

    # Prometheus evaluates the rule file itself: every rule must have run without error.
    for rule in alert_rules():
        prometheus.query(rule["expr"])  # the expression as written evaluates

    async def rule_health() -> list[tuple[str, str, str]]:
        groups = prometheus.api("rules")["groups"]
        return [
            (r["name"], r["health"], r.get("lastError", "")) for g in groups for r in g["rules"]
        ]

    health = await eventually(
        rule_health, 20, lambda found: len(found) == len(alert_rules())
        and all(h == "ok" for _, h, _ in found), every=0.5,
    )  # fmt: skip
    assert {name for name, _, _ in health} == {r["alert"] for r in alert_rules()}

    # The broken adapter is Degraded: its alert goes pending (its `for` has not passed yet).
    async def alerts() -> set[tuple[str, str | None]]:
        found = prometheus.api("alerts")["alerts"]
        return {(a["labels"]["alertname"], a["labels"].get("name")) for a in found}

    await eventually(alerts, 20, lambda found: ("LoRAAdapterDegraded", BROKEN) in found)
