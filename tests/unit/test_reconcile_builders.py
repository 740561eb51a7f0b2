"""The pure builders: a table of DynamoWorkers rendered into children and compared with golden
files (`DYNAMO_UPDATE_GOLDEN=1` rewrites them), plus the properties every rendering must have:
restricted pod security, the shutdown arithmetic, credentials by reference only, upstream's
discovery labels, owner references, and arguments the worker's own CLI accepts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynamo.runtime import cli as worker_cli
from dynamo_operator.api.dynamoworker import Drain
from dynamo_operator.reconcile.dynamoworker import interface as wi
from dynamo_operator.reconcile.dynamoworker.builders import (
    desired_children,
    desired_deployment,
    desired_pod_monitor,
    desired_role,
    desired_service,
)
from dynamo_operator.reconcile.dynamoworker.frontend import desired_frontend_children
from dynamo_operator.reconcile.dynamoworker.settings import ReconcileSettings
from dynamo_operator.reconcile.errors import SpecError
from support.api_cases import FULL_DYNAMO_WORKER, dynamo_worker, stored

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("DYNAMO_UPDATE_GOLDEN") == "1"
IMAGE = "registry.example.com/dynamo-worker:0.1"
DEFAULTS = ReconcileSettings(worker_image=IMAGE)
WITH_POD_MONITOR_CRD = ReconcileSettings(worker_image=IMAGE, pod_monitor_crd=True)


CASES: list[tuple[str, dict[str, Any], ReconcileSettings]] = [
    ("minimal", dynamo_worker(), DEFAULTS),
    ("full", FULL_DYNAMO_WORKER, DEFAULTS),
    (
        "lora-pvc-podmonitor",
        dynamo_worker(
            spec={
                "lora": {
                    "enabled": True,
                    "maxLoras": 2,
                    "cache": {"persistentVolumeClaim": {"claimName": "loras"}},
                }
            }
        ),
        WITH_POD_MONITOR_CRD,
    ),
    (
        "cpu-data-parallel",
        dynamo_worker(
            spec={
                "resources": {"gpusPerPod": 0, "cpu": "500m", "memory": 8589934592},
                "dataParallel": {"size": 4, "startRank": 8},
                "engine": {"class": "my.engines:Fast", "extraArgs": ["--dtype", "float32"]},
            }
        ),
        DEFAULTS,
    ),
    (
        "long-drain-budget",
        dynamo_worker(
            spec={
                "drain": {"gracePeriodSeconds": 30, "drainTimeoutSeconds": 3600},
                "tokenBudget": {"combinedLimit": 8192, "rejectTotalOverflow": True},
                "metrics": {"podMonitor": "Disabled"},
            }
        ),
        DEFAULTS,
    ),
]


def render(children: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(children, sort_keys=True, width=1 << 16)


@pytest.mark.parametrize(("case", "manifest", "settings"), CASES, ids=[c[0] for c in CASES])
def test_children_match_golden_files(
    case: str, manifest: dict[str, Any], settings: ReconcileSettings
) -> None:
    text = render(desired_children(stored(manifest), settings))
    path = GOLDEN / f"dynamoworker-{case}.yaml"
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"{path} is missing: run with DYNAMO_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{path.name} is stale: review, then DYNAMO_UPDATE_GOLDEN=1"


def test_rendering_is_deterministic() -> None:
    dw = stored(FULL_DYNAMO_WORKER)
    assert render(desired_children(dw, DEFAULTS)) == render(desired_children(dw, DEFAULTS))


def env_of(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e for e in container["env"]}


@pytest.mark.parametrize(
    ("grace", "drain", "expected"),
    [(5, 30, 55), (0, 0, 20), (30, 3600, 3650), (3600, 86400, 90020)],
)
def test_termination_grace_covers_grace_drain_and_cleanup(
    grace: int, drain: int, expected: int
) -> None:
    dw = stored(
        dynamo_worker(spec={"drain": {"gracePeriodSeconds": grace, "drainTimeoutSeconds": drain}})
    )
    deployment = desired_deployment(dw, DEFAULTS)
    pod = deployment["spec"]["template"]["spec"]
    env = env_of(deployment)
    shutdown = int(env["DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT"]["value"])
    assert pod["terminationGracePeriodSeconds"] == expected
    # Never shorter than what the spec asks to wait and drain, plus the cleanup margin.
    assert pod["terminationGracePeriodSeconds"] >= grace + drain + wi.CLEANUP_MARGIN_SECONDS
    # The runtime drains for min(drain, shutdown timeout - 5): the full drain timeout.
    assert min(drain, shutdown - wi.RUNTIME_DRAIN_RESERVE_SECONDS) == drain
    # Its own hard deadline (grace + shutdown timeout) comes before the kubelet's SIGKILL.
    assert grace + shutdown < pod["terminationGracePeriodSeconds"]
    assert env["DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS"]["value"] == str(grace)
    assert env["DYN_PREFILL_DRAIN_TIMEOUT_S"]["value"] == str(drain)
    assert wi.termination_grace_period_seconds(Drain(grace_period_seconds=grace,
        drain_timeout_seconds=drain)) == expected  # fmt: skip


ALLOWED_VOLUME_TYPES = {"emptyDir", "persistentVolumeClaim", "configMap", "secret", "projected"}


@pytest.mark.parametrize(("case", "manifest", "settings"), CASES, ids=[c[0] for c in CASES])
def test_pods_meet_the_restricted_pod_security_standard(
    case: str, manifest: dict[str, Any], settings: ReconcileSettings
) -> None:
    pod = desired_deployment(stored(manifest), settings)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod.get(key)
    for container in pod["containers"]:
        ctx = container["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False
        assert ctx["privileged"] is False
        assert ctx["capabilities"] == {"drop": ["ALL"]}
        assert ctx["runAsNonRoot"] is True
        assert ctx["readOnlyRootFilesystem"] is True
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
        assert not any("hostPort" in p for p in container["ports"])
    for volume in pod["volumes"]:
        kinds = set(volume) - {"name"}
        assert kinds <= ALLOWED_VOLUME_TYPES, volume
    # Writable places under the read-only root: /tmp, the caches, in-memory /dev/shm.
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    assert {"/tmp", "/var/cache/dynamo", "/dev/shm"} <= set(mounts)
    shm = next(v for v in pod["volumes"] if v["name"] == mounts["/dev/shm"])
    assert shm["emptyDir"]["medium"] == "Memory"


def test_shared_memory_lora_cache_and_gpus_follow_the_spec() -> None:
    pod = desired_deployment(stored(FULL_DYNAMO_WORKER), DEFAULTS)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["shm"]["emptyDir"]["sizeLimit"] == "16Gi"
    assert volumes["lora-cache"]["emptyDir"] == {"sizeLimit": "20Gi"}
    resources = pod["containers"][0]["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == "2"
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == "64Gi"
    env = env_of(desired_deployment(stored(FULL_DYNAMO_WORKER), DEFAULTS))
    assert env["DYN_LORA_ENABLED"]["value"] == "true"
    assert env["DYN_MAX_LORAS"]["value"] == "8"
    assert env["DYN_LORA_PATH"]["value"] == wi.LORA_PATH
    cpu_only = desired_deployment(
        stored(dynamo_worker(spec={"resources": {"gpusPerPod": 0}})), DEFAULTS
    )
    assert "nvidia.com/gpu" not in str(cpu_only)


def test_credentials_are_secret_references_never_values() -> None:
    env = env_of(desired_deployment(stored(FULL_DYNAMO_WORKER), DEFAULTS))
    assert env["AWS_ACCESS_KEY_ID"] == {
        "name": "AWS_ACCESS_KEY_ID",
        "valueFrom": {"secretKeyRef": {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"}},
    }
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "s3-creds"
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio.storage:9000"  # not a secret
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN"):
        assert "value" not in env[name]


def test_downward_api_and_runtime_env() -> None:
    dw = stored(dynamo_worker("llm", {"tokenBudget": {"combinedLimit": 4096}}), "team-a")
    env = env_of(desired_deployment(dw, DEFAULTS))
    assert {n: env[n]["valueFrom"]["fieldRef"]["fieldPath"] for n in wi.DOWNWARD_ENV} == {
        "POD_NAME": "metadata.name",
        "POD_NAMESPACE": "metadata.namespace",
        "POD_UID": "metadata.uid",
        "POD_IP": "status.podIP",
    }
    values = {n: e.get("value") for n, e in env.items()}
    assert values["DYN_NAMESPACE"] == "team-a-llm"
    assert values["DYN_SYSTEM_PORT"] == "9090"
    assert values["DYN_HTTP_PORT"] == "8000"
    assert values["DYN_DISCOVERY_BACKEND"] == "kubernetes"
    assert values["DYN_LORA_ENABLED"] == "false"
    assert "DYN_LORA_PATH" not in values
    assert values["DYN_TOKEN_BUDGET_COMBINED_LIMIT"] == "4096"
    assert values["DYN_TOKEN_BUDGET_REJECT_PROMPT_OVERFLOW"] == "false"


def test_every_runtime_variable_is_one_the_worker_reads() -> None:
    """The env table against the worker runtime's own source: a renamed variable fails here."""
    runtime = Path(worker_cli.__file__).parent
    source = "".join(p.read_text() for p in runtime.rglob("*.py"))
    upstream_only = {"DYN_COMPONENT"}  # upstream's operator sets it; our runtime ignores it
    for name in wi.Env:
        if name.startswith("DYN_") and name not in upstream_only:
            assert name in source, f"the worker runtime does not read {name}"


@pytest.mark.parametrize(("case", "manifest", "settings"), CASES, ids=[c[0] for c in CASES])
def test_arguments_parse_with_the_worker_cli(
    case: str, manifest: dict[str, Any], settings: ReconcileSettings
) -> None:
    dw = stored(manifest)
    container = desired_deployment(dw, settings)["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["dynamo-worker"]
    args, extras = worker_cli.build_parser().parse_known_args(container["args"])
    assert args.model == dw.spec.model.source
    assert args.served_model_name == dw.spec.model.served_name
    if dw.spec.engine.engine_class:
        assert args.engine == dw.spec.engine.engine_class
    if dw.spec.data_parallel.size > 1:
        assert args.data_parallel_size == dw.spec.data_parallel.size
        assert args.data_parallel_start_rank == dw.spec.data_parallel.start_rank
    if dw.spec.engine.extra_args:
        assert extras == ["--", *dw.spec.engine.extra_args]


def test_probes_use_the_system_port() -> None:
    container = desired_deployment(stored(dynamo_worker()), DEFAULTS)["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert container["livenessProbe"]["httpGet"] == {"path": "/live", "port": "system"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "system"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 7200
    assert {"name": "system", "containerPort": 9090, "protocol": "TCP"} in container["ports"]


def test_labels_owner_references_and_discovery() -> None:
    dw = stored(dynamo_worker("llm"))
    children = desired_children(dw, DEFAULTS)
    for child in children:
        meta = child["metadata"]
        assert meta["namespace"] == "serving"
        assert meta["labels"]["dynamo.dev/worker"] == "llm"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "dynamo-operator"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "dynamo.dev/v1alpha1",
                "kind": "DynamoWorker",
                "name": "llm",
                "uid": dw.metadata.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    discovery = {
        "nvidia.com/dynamo-discovery-backend": "kubernetes",
        "nvidia.com/dynamo-discovery-enabled": "true",
    }
    template = desired_deployment(dw, DEFAULTS)["spec"]["template"]["metadata"]["labels"]
    assert discovery.items() <= template.items()
    service = desired_service(dw)
    assert discovery.items() <= service["metadata"]["labels"].items()
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"dynamo.dev/worker": "llm"}


def test_pod_overrides_cannot_replace_operator_labels() -> None:
    dw = stored(dynamo_worker(spec={"pod": {"labels": {"app.kubernetes.io/name": "mine"}}}))
    labels = desired_deployment(dw, DEFAULTS)["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "dynamo-worker"


def test_role_allows_exactly_the_workers_metadata_and_local_reviews() -> None:
    role = desired_role(stored(dynamo_worker()))
    assert role["rules"] == [
        {
            "apiGroups": ["nvidia.com"],
            "resources": ["dynamoworkermetadatas"],
            "verbs": ["get", "create", "patch", "update", "delete"],
        },
        {
            "apiGroups": ["authorization.k8s.io"],
            "resources": ["localsubjectaccessreviews"],
            "verbs": ["create"],
        },
    ]


@pytest.mark.parametrize(
    ("mode", "crd", "pod_monitor", "annotations"),
    [
        ("Auto", True, True, False),
        ("Auto", False, False, True),
        ("Enabled", True, True, False),
        ("Enabled", False, False, False),  # nothing to create: status reports it
        ("Disabled", True, False, False),
        ("Disabled", False, False, False),
    ],
)
def test_pod_monitor_or_annotations(
    mode: str, crd: bool, pod_monitor: bool, annotations: bool
) -> None:
    dw = stored(dynamo_worker(spec={"metrics": {"podMonitor": mode}}))
    settings = ReconcileSettings(worker_image=IMAGE, pod_monitor_crd=crd)
    children = desired_children(dw, settings)
    assert any(c["kind"] == "PodMonitor" for c in children) == pod_monitor
    template = desired_deployment(dw, settings)["spec"]["template"]["metadata"]
    assert ("prometheus.io/scrape" in template.get("annotations", {})) == annotations
    monitor = desired_pod_monitor(dw)
    assert monitor["spec"]["podMetricsEndpoints"] == [{"port": "system", "path": "/metrics"}]


def test_missing_image_names_the_fix() -> None:
    with pytest.raises(SpecError, match=r"spec\.image .* --worker-image"):
        desired_deployment(stored(dynamo_worker()), ReconcileSettings())
    explicit = stored(dynamo_worker(spec={"image": "mine:1"}))
    assert "mine:1" in str(desired_deployment(explicit, ReconcileSettings()))


def test_extra_env_may_not_shadow_the_operators() -> None:
    dw = stored(dynamo_worker(spec={"pod": {"env": [{"name": "DYN_SYSTEM_PORT", "value": "1"}]}}))
    with pytest.raises(SpecError, match=r"spec\.pod\.env sets DYN_SYSTEM_PORT"):
        desired_deployment(dw, DEFAULTS)
    ok = stored(dynamo_worker(spec={"pod": {"env": [{"name": "MY_FLAG", "value": "1"}]}}))
    assert env_of(desired_deployment(ok, DEFAULTS))["MY_FLAG"] == {"name": "MY_FLAG", "value": "1"}


# --- spec.frontend ----------------------------------------------------------------------------

FRONTEND_SETTINGS = ReconcileSettings(worker_image=IMAGE, frontend_image="upstream:1.6.1")


def frontend_children(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    dw = stored(dynamo_worker("llm", {"frontend": spec}))
    return {c["kind"]: c for c in desired_frontend_children(dw, FRONTEND_SETTINGS)}


def test_no_frontend_without_spec_frontend() -> None:
    dw = stored(dynamo_worker("llm"))
    assert desired_frontend_children(dw, FRONTEND_SETTINGS) == []
    assert not [c for c in desired_children(dw, FRONTEND_SETTINGS) if "frontend" in str(c)]


def test_frontend_pods_are_never_selected_as_workers() -> None:
    children = frontend_children({})
    template = children["Deployment"]["spec"]["template"]
    worker_selector = desired_deployment(stored(dynamo_worker("llm")), DEFAULTS)["spec"][
        "selector"
    ]["matchLabels"]
    labels = template["metadata"]["labels"]
    # Neither the worker Deployment, Service, PDB nor the operator's pod index match it, and
    # upstream's discovery never lists it (no discovery labels on its pods or Service).
    assert not worker_selector.items() <= labels.items()
    assert "dynamo.dev/worker" not in labels
    assert not any(k.startswith("nvidia.com/dynamo-discovery") for k in labels)
    service = children["Service"]
    assert not any(
        k.startswith("nvidia.com/dynamo-discovery") for k in service["metadata"]["labels"]
    )
    assert service["spec"]["selector"] == {"dynamo.dev/frontend": "llm"}
    assert children["Deployment"]["spec"]["selector"]["matchLabels"] == {
        "dynamo.dev/frontend": "llm"
    }
    assert service["spec"]["type"] == "ClusterIP"


def test_frontend_is_scoped_to_this_workers_discovery() -> None:
    children = frontend_children({"routerMode": "kv", "extraArgs": ["--migration-limit", "3"]})
    container = children["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    values = {e["name"]: e.get("value") for e in container["env"]}
    worker_env = env_of(desired_deployment(stored(dynamo_worker("llm")), DEFAULTS))
    # The same Dynamo namespace, discovery backend and request plane as the workers'.
    for name in ("DYN_NAMESPACE", "DYN_DISCOVERY_BACKEND", "DYN_REQUEST_PLANE"):
        assert values[name] == worker_env[name]["value"], name
    assert values["DYN_REQUEST_PLANE"] == "tcp"
    assert values["DYN_ROUTER_MODE"] == "kv"
    assert values["DYN_HTTP_PORT"] == "8000"
    downward = {e["name"] for e in container["env"] if "valueFrom" in e}
    assert {"POD_NAME", "POD_NAMESPACE", "POD_UID"} <= downward
    assert container["command"] == ["python3", "-m", "dynamo.frontend"]
    assert container["args"] == ["--migration-limit", "3"]
    assert container["image"] == "upstream:1.6.1"


def test_frontend_role_only_reads_discovery() -> None:
    children = frontend_children({})
    rules = children["Role"]["rules"]
    assert {v for r in rules for v in r["verbs"]} == {"list", "watch"}
    assert {(g, res) for r in rules for g in r["apiGroups"] for res in r["resources"]} == {
        ("discovery.k8s.io", "endpointslices"),
        ("nvidia.com", "dynamoworkermetadatas"),
    }
    binding = children["RoleBinding"]
    assert binding["roleRef"]["name"] == binding["subjects"][0]["name"] == "llm-frontend"
    pod = children["Deployment"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "llm-frontend"


def test_frontend_pod_is_restricted() -> None:
    pod = frontend_children({})["Deployment"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    [container] = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert [v for v in pod["volumes"] if set(v) - {"name"} != {"emptyDir"}] == []
    home = {e["name"]: e.get("value") for e in container["env"]}["HOME"]
    assert home in {m["mountPath"] for m in container["volumeMounts"]}


def test_frontend_errors_name_the_field() -> None:
    dw = stored(dynamo_worker("llm", {"frontend": {}}))
    with pytest.raises(SpecError, match=r"spec\.frontend\.image .* --frontend-image"):
        desired_frontend_children(dw, DEFAULTS)
    clash = stored(
        dynamo_worker(
            "llm", {"frontend": {"pod": {"env": [{"name": "DYN_ROUTER_MODE", "value": "kv"}]}}}
        )
    )
    with pytest.raises(SpecError, match=r"spec\.frontend\.pod\.env sets DYN_ROUTER_MODE"):
        desired_frontend_children(clash, FRONTEND_SETTINGS)


@pytest.mark.parametrize(
    ("crd", "monitor", "annotated"), [(True, True, False), (False, False, True)]
)
def test_frontend_metrics_are_scraped_like_the_workers(
    crd: bool, monitor: bool, annotated: bool
) -> None:
    dw = stored(dynamo_worker("llm", {"frontend": {}}))
    settings = ReconcileSettings(worker_image=IMAGE, frontend_image="f:1", pod_monitor_crd=crd)
    children = {(c["kind"], c["metadata"]["name"]): c for c in desired_children(dw, settings)}
    frontend_monitor = children.get(("PodMonitor", "llm-frontend"))
    assert (frontend_monitor is not None) == monitor
    if frontend_monitor is not None:
        assert frontend_monitor["spec"]["selector"] == {
            "matchLabels": {"dynamo.dev/frontend": "llm"}
        }
        assert frontend_monitor["spec"]["podMetricsEndpoints"] == [
            {"port": "http", "path": "/metrics"}
        ]
    template = children[("Deployment", "llm-frontend")]["spec"]["template"]["metadata"]
    annotations = template.get("annotations", {})
    assert (annotations.get("prometheus.io/port") == "8000") == annotated
