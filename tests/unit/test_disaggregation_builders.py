"""Disaggregated serving (spec.prefill) in the builders: the prefill pods' children, their
labels and selectors, each role's command line, env, resources and NetworkPolicy.

An aggregated worker's children are the golden files of test_reconcile_builders.py; here they
are only checked to carry nothing of disaggregation.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from dynamo.runtime import cli as worker_cli
from dynamo_operator.api import DynamoWorker
from dynamo_operator.api.dynamoworker import DECODE, OWNED_FLAGS, PREFILL, WorkerRole
from dynamo_operator.reconcile.dynamoworker import disaggregation
from dynamo_operator.reconcile.dynamoworker.builders import (
    desired_children,
    desired_deployment,
    desired_network_policy,
)
from dynamo_operator.reconcile.dynamoworker.labels import selector_string, worker_of
from dynamo_operator.reconcile.dynamoworker.pod_summary import PodSummary
from dynamo_operator.reconcile.dynamoworker.settings import ReconcileSettings
from dynamo_operator.reconcile.errors import SpecError
from support.api_cases import dynamo_worker, stored

pytestmark = pytest.mark.unit

SETTINGS = ReconcileSettings(
    vllm_worker_image="vllm:1",
    frontend_image="frontend:1",
    operator_namespace="ops",
    pod_monitor_crd=True,
)
KV_ENV = {"VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT", "UCX_TCP_PORT_RANGE"}


def disaggregated(prefill: dict[str, Any] | None = None, **spec: Any) -> DynamoWorker:
    base = {
        "engine": {"name": "vllm", "extraArgs": ["--enforce-eager"]},
        "resources": {"gpusPerPod": 2, "memory": "32Gi"},
        "replicas": 3,
        "frontend": {},
        "prefill": prefill if prefill is not None else {},
    }
    return stored(dynamo_worker("llm", {**base, **spec}))


def aggregated() -> DynamoWorker:
    return stored(dynamo_worker("llm", {"engine": {"name": "vllm"}, "frontend": {}}))


def by_kind_and_name(children: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def pod_template(deployment: dict[str, Any]) -> dict[str, Any]:
    template: dict[str, Any] = deployment["spec"]["template"]
    return template


def main_container(deployment: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = pod_template(deployment)["spec"]["containers"][0]
    return container


def env_of(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in main_container(deployment)["env"]}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def engine_part(args: list[str]) -> list[str]:
    return args[args.index("--") + 1 :]


def test_aggregated_worker_carries_nothing_of_disaggregation() -> None:
    children = desired_children(aggregated(), SETTINGS)
    assert not any(c["metadata"]["name"].endswith("-prefill") for c in children)
    deployment = by_kind_and_name(children)[("Deployment", "llm")]
    assert "dynamo.dev/role" not in pod_template(deployment)["metadata"]["labels"]
    args = main_container(deployment)["args"]
    assert disaggregation.DISAGGREGATION_MODE_FLAG not in args
    assert "--kv-transfer-config" not in args
    assert not KV_ENV & set(env_of(deployment))
    policy = by_kind_and_name(children)[("NetworkPolicy", "llm")]
    assert all("endPort" not in p for r in policy["spec"]["ingress"] for p in r.get("ports", []))


def test_prefill_gets_its_own_deployment_service_pdb_monitor_and_policy() -> None:
    children = by_kind_and_name(desired_children(disaggregated(), SETTINGS))
    for kind in ("Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "PodMonitor"):
        assert (kind, "llm") in children, kind
        assert (kind, "llm-prefill") in children, kind
    # One identity for both roles.
    for kind in ("ServiceAccount", "Role", "RoleBinding"):
        assert (kind, "llm-worker") in children
        assert (kind, "llm-prefill") not in children
    prefill = children[("Deployment", "llm-prefill")]
    assert prefill["spec"]["replicas"] == 1
    assert pod_template(prefill)["spec"]["serviceAccountName"] == "llm-worker"
    assert prefill["metadata"]["ownerReferences"][0]["name"] == "llm"


def test_decode_selector_is_unchanged_and_never_takes_a_prefill_pod() -> None:
    children = by_kind_and_name(desired_children(disaggregated(), SETTINGS))
    decode, prefill = children[("Deployment", "llm")], children[("Deployment", "llm-prefill")]
    decode_labels = pod_template(decode)["metadata"]["labels"]
    prefill_labels = pod_template(prefill)["metadata"]["labels"]
    # The decode Deployment's selector is immutable: exactly the aggregated worker's.
    aggregated_deployment = by_kind_and_name(desired_children(aggregated(), SETTINGS))
    assert (
        decode["spec"]["selector"]
        == aggregated_deployment[("Deployment", "llm")]["spec"]["selector"]
    )
    assert decode["spec"]["selector"] == {"matchLabels": {"dynamo.dev/worker": "llm"}}
    assert prefill["spec"]["selector"] == {"matchLabels": {"dynamo.dev/prefill": "llm"}}
    assert "dynamo.dev/worker" not in prefill_labels
    assert decode_labels["dynamo.dev/role"] == "decode"
    assert prefill_labels["dynamo.dev/role"] == "prefill"
    assert prefill_labels["app.kubernetes.io/instance"] == "llm"
    # Both roles are discovered by upstream's frontend.
    for labels in (decode_labels, prefill_labels):
        assert labels["nvidia.com/dynamo-discovery-enabled"] == "true"
        assert labels["app.kubernetes.io/component"] == "worker"
    for kind in ("Service", "PodDisruptionBudget", "PodMonitor", "NetworkPolicy"):
        decode_selector = _selector(children[(kind, "llm")])
        prefill_selector = _selector(children[(kind, "llm-prefill")])
        assert selects(decode_selector, decode_labels), kind
        assert not selects(decode_selector, prefill_labels), kind
        assert selects(prefill_selector, prefill_labels), kind
        assert not selects(prefill_selector, decode_labels), kind
    prefill_service = children[("Service", "llm-prefill")]
    assert prefill_service["spec"]["ports"] == children[("Service", "llm")]["spec"]["ports"]
    assert prefill_service["metadata"]["labels"]["nvidia.com/dynamo-discovery-backend"]
    # status.selector (the scale subresource) counts decode pods only.
    assert selector_string("llm") == "dynamo.dev/worker=llm"


def _selector(child: dict[str, Any]) -> dict[str, str]:
    spec = child["spec"]
    if child["kind"] == "Service":
        selector: dict[str, str] = spec["selector"]
        return selector
    if child["kind"] == "NetworkPolicy":
        return dict(spec["podSelector"]["matchLabels"])
    return dict(spec["selector"]["matchLabels"])


def test_each_role_is_told_its_side_of_the_kv_transfer() -> None:
    dw = disaggregated()
    decode = main_container(desired_deployment(dw, SETTINGS, role="decode"))["args"]
    prefill = main_container(desired_deployment(dw, SETTINGS, role="prefill"))["args"]
    for args, role, kv_role in (
        (decode, "decode", "kv_consumer"),
        (prefill, "prefill", "kv_producer"),
    ):
        # The worker's own flag, before the engine's arguments.
        mode = args.index("--disaggregation-mode")
        assert args[mode + 1] == role
        assert mode < args.index("--")
        engine = engine_part(args)
        config = engine[engine.index("--kv-transfer-config") + 1]
        assert config == f'{{"kv_connector":"NixlConnector","kv_role":"{kv_role}"}}'
        assert json.loads(config) == {"kv_connector": "NixlConnector", "kv_role": kv_role}
        assert engine[-1] == "--enforce-eager"


@pytest.mark.parametrize("role", [DECODE, PREFILL])
def test_each_roles_arguments_parse_with_the_worker_cli(role: WorkerRole) -> None:
    args = main_container(desired_deployment(disaggregated(), SETTINGS, role=role))["args"]
    parsed, extras = worker_cli.build_parser().parse_known_args(args)
    assert parsed.disaggregation_mode == role
    assert extras[0] == "--"


def test_prefill_inherits_the_decode_roles_values() -> None:
    dw = disaggregated({"replicas": 2}, dataParallel={"size": 2})
    decode = desired_deployment(dw, SETTINGS, role="decode")
    prefill = desired_deployment(dw, SETTINGS, role="prefill")
    assert (decode["spec"]["replicas"], prefill["spec"]["replicas"]) == (3, 2)
    assert main_container(prefill)["resources"] == main_container(decode)["resources"]
    prefill_args = main_container(prefill)["args"]
    assert prefill_args[prefill_args.index("--data-parallel-size") + 1] == "2"
    engine = engine_part(prefill_args)
    assert engine[engine.index("--tensor-parallel-size") + 1] == "1"  # 2 GPUs over 2 ranks
    assert engine[-1] == "--enforce-eager"


def test_prefill_fields_override_the_decode_roles() -> None:
    dw = disaggregated(
        {
            "resources": {"gpusPerPod": 4},
            "dataParallel": {"size": 2},
            "engine": {"extraArgs": ["--max-num-batched-tokens", "8192"]},
            "pod": {"nodeSelector": {"gpu": "h100"}, "labels": {"tier": "prefill"}},
        },
        pod={"nodeSelector": {"gpu": "l4"}},
    )
    decode = desired_deployment(dw, SETTINGS, role="decode")
    prefill = desired_deployment(dw, SETTINGS, role="prefill")
    assert main_container(prefill)["resources"] == {
        "requests": {"nvidia.com/gpu": "4"},
        "limits": {"nvidia.com/gpu": "4"},
    }
    assert main_container(decode)["resources"]["limits"] == {
        "memory": "32Gi",
        "nvidia.com/gpu": "2",
    }
    engine = engine_part(main_container(prefill)["args"])
    assert engine[engine.index("--tensor-parallel-size") + 1] == "2"  # 4 GPUs over 2 ranks
    assert engine[-2:] == ["--max-num-batched-tokens", "8192"]
    assert "--enforce-eager" not in engine
    assert "--data-parallel-size" not in main_container(decode)["args"]
    assert pod_template(prefill)["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert pod_template(decode)["spec"]["nodeSelector"] == {"gpu": "l4"}
    assert pod_template(prefill)["metadata"]["labels"]["tier"] == "prefill"
    assert "tier" not in pod_template(decode)["metadata"]["labels"]


def test_both_roles_get_the_kv_transfer_env() -> None:
    dw = disaggregated()
    for role in ("decode", "prefill"):
        env = env_of(desired_deployment(dw, SETTINGS, role=role))
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {
            "name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
        }
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5600"
        assert env["UCX_TCP_PORT_RANGE"]["value"] == "20000-20999"


@pytest.mark.parametrize(
    ("spec", "role", "field"),
    [
        ({"pod": {"env": [{"name": "UCX_TCP_PORT_RANGE", "value": "1-2"}]}}, "decode", "spec.pod"),
        # The prefill pods take spec.pod when spec.prefill.pod is unset.
        ({"pod": {"env": [{"name": "UCX_TCP_PORT_RANGE", "value": "1-2"}]}}, "prefill", "spec.pod"),
    ],
)
def test_spec_pod_may_not_set_the_kv_transfer_env(
    spec: dict[str, Any], role: WorkerRole, field: str
) -> None:
    with pytest.raises(SpecError, match=rf"^{field}\.env sets UCX_TCP_PORT_RANGE"):
        desired_deployment(disaggregated(**spec), SETTINGS, role=role)


def test_prefill_pod_env_clashes_name_spec_prefill_pod() -> None:
    dw = disaggregated({"pod": {"env": [{"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": "7000"}]}})
    with pytest.raises(
        SpecError, match=r"^spec\.prefill\.pod\.env sets VLLM_NIXL_SIDE_CHANNEL_PORT"
    ):
        desired_deployment(dw, SETTINGS, role="prefill")
    desired_deployment(dw, SETTINGS, role="decode")  # spec.pod is the decode role's


def test_an_aggregated_worker_may_set_the_kv_transfer_env_itself() -> None:
    manifest = dynamo_worker(
        "llm",
        {
            "engine": {"name": "vllm"},
            "pod": {"env": [{"name": "UCX_TCP_PORT_RANGE", "value": "1-2"}]},
        },
    )
    env = env_of(desired_deployment(stored(manifest), SETTINGS))
    assert env["UCX_TCP_PORT_RANGE"]["value"] == "1-2"


@pytest.mark.parametrize(("decode_size", "prefill_size", "end"), [(1, 1, 5600), (2, 4, 5603)])
def test_kv_transfer_ports_open_only_between_the_roles(
    decode_size: int, prefill_size: int, end: int
) -> None:
    dw = disaggregated(
        {"resources": {"gpusPerPod": 4}, "dataParallel": {"size": prefill_size}},
        dataParallel={"size": decode_size},
        networkPolicy={"clientNamespaces": ["gateway"], "systemPortNamespaces": ["monitoring"]},
    )
    ports = [
        {"port": 5600, "endPort": end, "protocol": "TCP"},
        {"port": 20000, "endPort": 20999, "protocol": "TCP"},
    ]
    aggregated_ingress = desired_network_policy(
        stored(
            dynamo_worker(
                "llm",
                {
                    "engine": {"name": "vllm"},
                    "frontend": {},
                    "networkPolicy": {
                        "clientNamespaces": ["gateway"],
                        "systemPortNamespaces": ["monitoring"],
                    },
                },
            )
        ),
        SETTINGS,
    )["spec"]["ingress"]
    for role, peer in (
        (DECODE, {"dynamo.dev/prefill": "llm"}),
        (PREFILL, {"dynamo.dev/worker": "llm"}),
    ):
        policy = desired_network_policy(dw, SETTINGS, role=role)
        *common, kv = policy["spec"]["ingress"]
        # Everything an aggregated worker's pods admit, both roles admit.
        assert common == aggregated_ingress
        assert kv == {
            "from": [
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": "serving"}
                    },
                    "podSelector": {"matchLabels": peer},
                }
            ],
            "ports": ports,
        }
        # Nobody else is given the ranges.
        assert all("endPort" not in p for r in common for p in r.get("ports", []))


def test_disaggregated_engine_flags_are_owned() -> None:
    """Every flag a disaggregated role's engine gets from the spec is one its extraArgs may not
    repeat (OWNED_FLAGS and --kv-transfer-config)."""
    dw = disaggregated(
        {"resources": {"gpusPerPod": 2}},
        dataParallel={"size": 2, "startRank": 2},
        lora={"enabled": True},
        tokenBudget={"combinedLimit": 128},
        engine={"name": "vllm"},
    )
    owned = {f.spellings[0] for f in OWNED_FLAGS} | {"--kv-transfer-config"}
    for role in (DECODE, PREFILL):
        args = main_container(desired_deployment(dw, SETTINGS, role=role))["args"]
        passed = {a for a in args if a.startswith("-") and a != "--engine"} - {"--"}
        # The worker's own flags that it hands on (--model, the data-parallel flags, the
        # role), then the spec's engine flags, then extraArgs (none here).
        assert passed == owned - {"--max-loras"}  # LoRA's slots reach the worker as env


def test_removing_spec_prefill_drops_the_prefill_children_from_the_desired_ones() -> None:
    names = {c["metadata"]["name"] for c in desired_children(aggregated(), SETTINGS)}
    assert "llm-prefill" not in names


def test_pod_summaries_and_the_pod_index_know_both_roles() -> None:
    children = by_kind_and_name(desired_children(disaggregated(), SETTINGS))
    for name, role in (("llm", "decode"), ("llm-prefill", "prefill")):
        labels = pod_template(children[("Deployment", name)])["metadata"]["labels"]
        assert worker_of(labels) == "llm"
        summary = PodSummary.from_pod({"metadata": {"name": "p", "labels": labels}})
        assert summary.role == role
    assert PodSummary.from_pod({"metadata": {"name": "p", "labels": {}}}).role is None
    assert worker_of({"app.kubernetes.io/instance": "llm"}) is None
