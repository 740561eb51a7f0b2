"""The Helm chart, rendered by the real helm binary (no cluster): lint, golden output, the
values schema, the operator's command line, the CRD templates, and RBAC derived from the code.

Golden files: tests/unit/golden/chart/<case>.yaml, the `helm template` output without the CRD
documents (those are checked against the generated CRDs instead, so a model change does not
touch these files). Regenerate with DYNAMO_UPDATE_GOLDEN=1 and review the diff.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynamo.runtime.system import auth as admin_auth
from dynamo_operator import cli
from dynamo_operator.api import DynamoWorker, crd
from dynamo_operator.api import metadata as dwm
from dynamo_operator.handlers import build_registry
from dynamo_operator.k8s import kinds
from dynamo_operator.pods.credentials import DEFAULT_TOKEN_FILE, WORKER_ADMIN_AUDIENCE
from dynamo_operator.reconcile.dynamoworker import builders, model_cache
from dynamo_operator.reconcile.dynamoworker.reconciler import ACTIVATOR_KINDS, FRONTEND_KINDS
from dynamo_operator.reconcile.dynamoworker.settings import ReconcileSettings
from support.api_cases import FULL_DYNAMO_WORKER
from support.helm import CHART, RENDER_KUBE_VERSION, documents, require_helm, run_helm, template

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).parent / "golden" / "chart"
UPDATE = os.environ.get("DYNAMO_UPDATE_GOLDEN") == "1"
REPO = Path(__file__).resolve().parents[2]
OPERATOR_CODE = REPO / "operator" / "src" / "dynamo_operator"

CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "namespaced": {
        "rbac": {"scope": "namespaced", "watchNamespaces": ["team-a", "team-b"]},
        "workerDefaults": {
            "image": "registry.example.com/dynamo-worker:0.1.0",
            "imagePullSecrets": [{"name": "regcred"}],
        },
        "operator": {"logLevel": "debug"},
    },
    "metrics": {
        "metrics": {
            "port": 9000,
            "service": {"port": 9100, "annotations": {"prometheus.io/scrape": "true"}},
            "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "kps"}},
        },
    },
}
Permission = tuple[str, str, str, tuple[str, ...]]  # (group, resource, verb, resourceNames)


@pytest.fixture(scope="module")
def helm() -> Path:
    return require_helm()


def render(helm: Path, values: dict[str, Any] | None = None, **kwargs: Any) -> list[dict[str, Any]]:
    return documents(template(helm, values, **kwargs).stdout)


def without_crds(text: str) -> str:
    """`helm template` output without the documents rendered from templates/crds/."""
    docs = text.split("\n---\n")
    kept = [d for d in docs if "# Source: dynamo-operator/templates/crds/" not in d]
    return "\n---\n".join(kept).strip() + "\n"


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert len(spec["containers"]) == 1
    return dict(spec["containers"][0])


def permissions(rules: list[dict[str, Any]]) -> set[Permission]:
    return {
        (group, resource, verb, tuple(rule.get("resourceNames") or ()))
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


# -- lint and golden output ----------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_lint_is_clean(helm: Path, case: str) -> None:
    values = CASES[case]
    args = [a for k, v in values.items() for a in ("--set-json", f"{k}={json.dumps(v)}")]
    result = run_helm(
        helm, "lint", str(CHART), "--strict", "--kube-version", RENDER_KUBE_VERSION, *args
    )
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout
    assert "[WARNING]" not in result.stdout, result.stdout
    assert "[ERROR]" not in result.stdout, result.stdout


@pytest.mark.parametrize("case", sorted(CASES))
def test_template_matches_golden(helm: Path, case: str) -> None:
    text = without_crds(template(helm, CASES[case]).stdout)
    path = GOLDEN / f"{case}.yaml"
    if UPDATE:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"{path} is missing: run with DYNAMO_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{path.name} is stale: review, then DYNAMO_UPDATE_GOLDEN=1"


# -- the values schema ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"metrics": {"port": "8080"}}, "at '/metrics/port': got string, want integer"),
        ({"replicaCount": 0}, "at '/replicaCount': minimum"),
        ({"leaderElection": {"enabled": "yes"}}, "at '/leaderElection/enabled': got string"),
        ({"rbac": {"scope": "global"}}, "at '/rbac/scope': value must be one of"),
        ({"crds": {"keep": "yes"}}, "at '/crds/keep': got string, want boolean"),
        ({"crds": {"keepp": True}}, "additional properties 'keepp' not allowed"),
        ({"workerDefaults": {"image": 5}}, "at '/workerDefaults/image': got number, want string"),
        ({"rbac": {"watchNamespaces": ["Team_A"]}}, "at '/rbac/watchNamespaces/0'"),
        ({"health": {"port": 70000}}, "at '/health/port': maximum"),
        ({"operator": {"logLevel": "trace"}}, "at '/operator/logLevel': value must be one of"),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else "",
)
def test_schema_refuses_bad_values(helm: Path, values: dict[str, Any], message: str) -> None:
    result = template(helm, values, check=False)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert message in result.stderr, result.stderr


def test_every_value_is_in_the_schema_and_documented() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(value: Any, node: dict[str, Any], path: str) -> None:
        if "properties" not in node:
            return  # a free-form Kubernetes object (resources, securityContext, ...)
        assert node.get("additionalProperties") is False, f"{path or '/'}: unknown keys pass"
        assert set(value) == set(node["properties"]) - {"global"}, path
        for key, sub in node["properties"].items():
            assert sub.get("type"), f"{path}/{key} has no type in the schema"
            assert sub.get("description"), f"{path}/{key} has no description in the schema"
            if key in value:
                walk(value[key], sub, f"{path}/{key}")

    walk(values, schema, "")
    # Every key of values.yaml comes right after a comment (values of free-form objects,
    # such as the keys of podSecurityContext, are documented by the comment of their key).
    lines = (CHART / "values.yaml").read_text().splitlines()
    free = {"podSecurityContext", "securityContext", "resources"}
    stack: list[tuple[int, str]] = []
    for number, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z][A-Za-z0-9]*):", line)
        if not match:
            continue
        indent, key = len(match.group(1)), match.group(2)
        stack = [(i, k) for i, k in stack if i < indent]
        if not any(k in free for _, k in stack):
            above = lines[number - 1].strip()
            assert above.startswith("#"), f"values.yaml line {number + 1}: {key} is undocumented"
        stack.append((indent, key))


# -- the Deployment and the operator's command line -------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_operator_command_line_is_one_the_operator_accepts(helm: Path, case: str) -> None:
    main = container(render(helm, CASES[case]))
    assert main["command"] == ["dynamo-operator"]
    args = cli._parser().parse_args(main["args"])
    assert args.command == "run"
    assert args.install_crds is False, "the chart installs the CRDs"
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert args.health_port == ports["health"]
    assert args.metrics_port == ports["metrics"]


def test_deployment_runs_one_restricted_operator_with_probes(helm: Path) -> None:
    docs = render(helm)
    deployment = one(docs, "Deployment")
    # A leader and a standby; a rollout starts a new standby before it stops an old pod.
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    pod = deployment["spec"]["template"]["spec"]
    main = container(docs)
    for probe in ("startupProbe", "livenessProbe"):
        assert main[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe
    # A standby that cannot read the Lease is not ready; without an election kopf serves
    # /healthz alone.
    assert main["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    alone = container(render(helm, {"leaderElection": {"enabled": False}, "replicaCount": 1}))
    assert alone["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert main["resources"]["requests"]
    assert main["resources"]["limits"]["memory"]
    # The `restricted` Pod Security Standard.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert main["securityContext"]["allowPrivilegeEscalation"] is False
    assert main["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]
    args = cli._parser().parse_args(main["args"])
    assert args.all_namespaces
    # The images the release publishes, under the chart's appVersion.
    chart = yaml.safe_load((REPO / "helm" / "dynamo-operator" / "Chart.yaml").read_text())
    version = chart["appVersion"]
    assert main["image"] == f"ghcr.io/dynamo-operator/dynamo-operator:{version}"
    assert args.worker_image == f"ghcr.io/dynamo-operator/dynamo-worker:{version}"
    assert args.vllm_worker_image == f"ghcr.io/dynamo-operator/dynamo-worker-vllm:{version}"
    assert args.frontend_image == f"ghcr.io/dynamo-operator/dynamo-frontend:{version}"
    assert args.leader_election
    assert args.lease_name == "dynamo-operator-leader"
    assert (args.lease_duration_seconds, args.lease_retry_seconds) == (15, 2)
    env = {e["name"]: e for e in main["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


def test_without_leader_election_one_replica_recreates(helm: Path) -> None:
    values = {"replicaCount": 1, "leaderElection": {"enabled": False}}
    docs = render(helm, values)
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert not cli._parser().parse_args(container(docs)["args"]).leader_election
    assert not [d for d in docs if d["metadata"]["name"].endswith("-leader-election")]
    result = template(helm, {"leaderElection": {"enabled": False}}, check=False)
    assert result.returncode != 0
    assert "replicaCount > 1 needs leaderElection.enabled" in result.stderr


def test_values_reach_the_operator(helm: Path) -> None:
    values = {
        "workerDefaults": {
            "image": "registry.example.com/dynamo-worker:1.2",
            "vllmImage": "registry.example.com/dynamo-worker-vllm:1.2",
            "imagePullSecrets": [{"name": "worker-pull"}, {"name": "mirror-pull"}],
            "frontendImage": "registry.example.com/dynamo-frontend:1.6.1",
        },
        "operator": {"logLevel": "warning", "resyncSeconds": 12.5, "extraArgs": ["--verbose"]},
        "metrics": {"enabled": False},
        "health": {"port": 9999},
        "imagePullSecrets": [{"name": "regcred"}],
        "image": {"repository": "example.com/op", "tag": "v9"},
    }
    docs = render(helm, values)
    main = container(docs)
    assert main["image"] == "example.com/op:v9"
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["imagePullSecrets"] == [
        {"name": "regcred"}
    ]
    assert main["args"][-1] == "--verbose"
    args = cli._parser().parse_args(main["args"][:-1])
    assert args.worker_image == "registry.example.com/dynamo-worker:1.2"
    assert args.vllm_worker_image == "registry.example.com/dynamo-worker-vllm:1.2"
    assert args.worker_image_pull_secrets == ["worker-pull", "mirror-pull"]
    assert args.frontend_image == "registry.example.com/dynamo-frontend:1.6.1"
    assert args.quiet
    assert args.resync_seconds == 12.5
    assert args.metrics_port == -1
    assert args.health_port == 9999
    assert [p["name"] for p in main["ports"]] == ["health"]
    assert not [d for d in docs if d["kind"] in ("Service", "ServiceMonitor")]


# -- RBAC ----------------------------------------------------------------------------------


def required_permissions() -> tuple[set[Permission], set[Permission]]:
    """What the operator's code needs: (namespaced, cluster-scoped) permissions."""
    need: set[Permission] = set()
    # kopf lists and watches every resource a handler or index is registered for, and
    # patches those it runs change handlers or daemons on (finalizer, progress annotations).
    registry = build_registry()
    for attr in ("_indexing", "_watching", "_spawning", "_changing"):
        for handler in getattr(registry, attr).get_all_handlers():
            selector = handler.selector
            assert selector is not None
            # Handlers name their resource by plural (e.g. "pods"), which kopf keeps as any_name.
            group, plural = selector.group or "", selector.plural or selector.any_name
            need |= {(group, plural, v, ()) for v in ("list", "watch")}
            if attr in ("_spawning", "_changing"):
                need.add((group, plural, "patch", ()))
    # Every child is read, then server-side applied (create + patch).
    settings = ReconcileSettings(worker_image="x", frontend_image="y", pod_monitor_crd=True)
    stored = copy.deepcopy(FULL_DYNAMO_WORKER)
    stored["metadata"] |= {"namespace": "ns", "uid": "u"}
    stored["spec"]["metrics"] = {"podMonitor": "Enabled"}
    # Scale to zero: the activator's children too.
    stored["spec"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 2, "targetInFlightPerPod": 1}
    dw = DynamoWorker.model_validate(stored)
    for child in builders.desired_children(dw, settings):
        group = child["apiVersion"].rpartition("/")[0]
        need |= {(group, kinds.kind_of(child).plural, v, ()) for v in ("get", "create", "patch")}
    # spec.model.cache: its claim and Jobs are read and applied like the other children; an
    # existing claim is read; the fill pods are listed by their Job and their log read.
    cached = copy.deepcopy(stored)
    cached["spec"]["model"] = {"name": "m", "source": "s3://b/m", "cache": {"size": "1Gi"}}
    cache_dw = DynamoWorker.model_validate(cached)
    claim = model_cache.desired_claim(cache_dw)
    assert claim is not None
    for child in (
        claim,
        model_cache.desired_fill_job(cache_dw, settings, 1),
        model_cache.desired_prune_job(cache_dw, settings),
    ):
        group = child["apiVersion"].rpartition("/")[0]
        need |= {(group, kinds.kind_of(child).plural, v, ()) for v in ("get", "create", "patch")}
    # Reads, deletes and status patches of a named kind, as the source spells them
    # (`cluster.get(kinds.POD_MONITOR, ...)`); CRDs are cluster-scoped, checked below.
    source = "\n".join(
        p.read_text()
        for d in ("reconcile", "handlers", "pods")
        for p in sorted((OPERATOR_CODE / d).rglob("*.py"))
    )
    # Children deleted when no longer wanted (`WorkerReconciler._remove_unwanted`): read, then
    # deleted when owned.
    assert "candidates.append((kinds.POD_MONITOR" in source
    assert "(kinds.NETWORK_POLICY, network_policy_name(name))" in source
    assert "(kinds.PERSISTENT_VOLUME_CLAIM, model_cache_claim_name(name))" in source
    assert "(kind, activator_name(name)) for kind in ACTIVATOR_KINDS" in source
    for kind in (
        kinds.POD_MONITOR,
        kinds.NETWORK_POLICY,
        kinds.PERSISTENT_VOLUME_CLAIM,
        *FRONTEND_KINDS,
        *ACTIVATOR_KINDS,
    ):
        group = kind.api_version.rpartition("/")[0]
        need |= {(group, kind.plural, v, ()) for v in ("get", "delete")}
    verbs = {
        "get": "get",
        "_get": "get",
        "list": "list",
        "_get_list": "list",
        "delete": "delete",
        "patch_status": "patch",
        "patch": "patch",
    }
    for method, name in re.findall(
        r"\.(get|_get|list|_get_list|delete|patch_status|patch)\(\s*kinds\.([A-Z_]+)", source
    ):
        kind = getattr(kinds, name)
        if kind is kinds.CRD:
            continue
        suffix = "/status" if method == "patch_status" else ""
        group = kind.api_version.rpartition("/")[0]
        need.add((group, kind.plural + suffix, verbs[method], ()))
    # Status patches of each kind go through its `StatusWriter(cluster, kinds.X, ...)`.
    assert re.search(r"\.patch_status\(\s*self\.kind,", source)
    for name in re.findall(r"StatusWriter\(\s*[\w.]+,\s*kinds\.([A-Z_]+)", source):
        kind = getattr(kinds, name)
        group = kind.api_version.rpartition("/")[0]
        need.add((group, kind.plural + "/status", "patch", ()))
    # The LoRA-adapters readiness gate, set on worker pods (a strategic merge patch).
    assert "patch_pod_conditions(" in source
    need.add(("", "pods/status", "patch", ()))
    assert "pod_log_tail(" in source  # the fill's progress
    need.add(("", "pods/log", "get", ()))
    assert "create_event(" in source
    need.add(("events.k8s.io", "events", "create", ()))  # the reconciler's Events
    need.add(("", "events", "create", ()))  # kopf posts core/v1 Events (posting is on)
    # The workers', the frontend's and the activator's Roles: RBAC lets the operator grant
    # only what it holds.
    roles = [c for c in builders.desired_children(dw, settings) if c["kind"] == "Role"]
    assert len(roles) == 3
    for role in roles:
        need |= permissions(role["rules"])
    # Worker pods admit the operator's requests only if it may do what their admin check asks
    # (dynamo.runtime.system.auth); the pod clients send its token on every request.
    assert "BearerToken(" in (OPERATOR_CODE / "handlers" / "context.py").read_text()
    need.add(
        (admin_auth.GROUP, f"{admin_auth.RESOURCE}/{admin_auth.SUBRESOURCE}", admin_auth.VERB, ())
    )
    # Cluster-scoped: whether the PodMonitor CRD exists.
    assert "crd_exists(POD_MONITOR_CRD)" in source
    crds = ("apiextensions.k8s.io", "customresourcedefinitions")
    # A grant limited to some names (the activator's own EndpointSlice) is held already when
    # the operator needs the same verb on every object of the kind.
    need = {(g, r, v, names) for g, r, v, names in need if not names or (g, r, v, ()) not in need}
    return need, {(*crds, "get", (builders.POD_MONITOR_CRD,))}


# Needed where the code cannot show it: with the OwnerReferencesPermissionEnforcement admission
# plugin (OpenShift), setting blockOwnerDeletion on a child asks for update on the owner's
# finalizers.
EXTRA = {("dynamo.dev", "dynamoworkers/finalizers", "update", ())}


def test_cluster_role_grants_exactly_what_the_code_uses(helm: Path) -> None:
    namespaced, cluster = required_permissions()
    # The derivation finds what it should.
    assert ("nvidia.com", dwm.PLURAL, "create", ()) in namespaced
    assert ("dynamo.dev", "dynamoworkers/status", "patch", ()) in namespaced
    assert ("monitoring.coreos.com", "podmonitors", "delete", ()) in namespaced
    granted = permissions(one(render(helm), "ClusterRole", "dynamo-operator")["rules"])
    assert granted - (namespaced | cluster | EXTRA) == set(), "granted but never used"
    assert (namespaced | cluster) - granted == set(), "used but not granted"


def test_namespaced_scope_grants_the_same_per_namespace(helm: Path) -> None:
    namespaced, cluster = required_permissions()
    values = {"rbac": {"scope": "namespaced", "watchNamespaces": ["team-a", "team-b"]}}
    docs = render(helm, values, namespace="ops")
    roles = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "dynamo-operator"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert permissions(role["rules"]) == namespaced | EXTRA
    bindings = [
        d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["name"] == "dynamo-operator"
    ]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for binding in bindings:
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "dynamo-operator", "namespace": "ops"}
        ]
    assert permissions(one(docs, "ClusterRole", "dynamo-operator-crds")["rules"]) == cluster
    args = cli._parser().parse_args(container(docs)["args"])
    assert args.namespaces == ["team-a", "team-b"]
    assert not args.all_namespaces
    # No namespaces listed: the release namespace.
    docs = render(helm, {"rbac": {"scope": "namespaced"}}, namespace="ops")
    assert [
        r["metadata"]["namespace"]
        for r in docs
        if r["kind"] == "Role" and r["metadata"]["name"] == "dynamo-operator"
    ] == ["ops"]
    assert cli._parser().parse_args(container(docs)["args"]).namespaces == ["ops"]


@pytest.mark.parametrize(
    ("values", "groups"),
    [
        ({}, ["system:serviceaccounts"]),
        (
            {"rbac": {"scope": "namespaced", "watchNamespaces": ["team-a", "team-b"]}},
            ["system:serviceaccounts:team-a", "system:serviceaccounts:team-b"],
        ),
    ],
)
def test_workers_may_review_tokens_and_nothing_more(
    helm: Path, values: dict[str, Any], groups: list[str]
) -> None:
    """The workers' TokenReview comes from the chart (a cluster-scoped kind, granted to the
    watched namespaces' service accounts); their SubjectAccessReviews are local, in their
    Role (see test_cluster_role_grants_exactly_what_the_code_uses)."""
    docs = render(helm, values, namespace="ops")
    name = "dynamo-operator-worker-token-review"
    role = one(docs, "ClusterRole", name)
    assert permissions(role["rules"]) == {("authentication.k8s.io", "tokenreviews", "create", ())}
    binding = one(docs, "ClusterRoleBinding", name)
    assert binding["roleRef"]["name"] == name
    assert [s["name"] for s in binding["subjects"]] == groups
    assert {s["kind"] for s in binding["subjects"]} == {"Group"}
    worker_role = next(
        c
        for c in builders.desired_children(
            DynamoWorker.model_validate(
                {**FULL_DYNAMO_WORKER, "metadata": {"name": "w", "namespace": "ns", "uid": "u"}}
            ),
            ReconcileSettings(worker_image="x"),
        )
        if c["kind"] == "Role"
    )
    assert ("authorization.k8s.io", "localsubjectaccessreviews", "create", ()) in permissions(
        worker_role["rules"]
    )
    assert not {p for p in permissions(worker_role["rules"]) if p[1] == "subjectaccessreviews"}


def test_operator_sends_a_projected_token_for_the_workers_audience(helm: Path) -> None:
    docs = render(helm)
    spec = one(docs, "Deployment")["spec"]["template"]["spec"]
    volume = next(v for v in spec["volumes"] if v["name"] == "worker-admin-token")
    [source] = volume["projected"]["sources"]
    assert source["serviceAccountToken"]["audience"] == admin_auth.AUDIENCE == WORKER_ADMIN_AUDIENCE
    [mount] = [m for m in container(docs)["volumeMounts"] if m["name"] == "worker-admin-token"]
    token = Path(mount["mountPath"]) / source["serviceAccountToken"]["path"]
    assert token == DEFAULT_TOKEN_FILE


@pytest.mark.parametrize("scope", ["cluster", "namespaced"])
def test_rbac_has_no_wildcards_secrets_or_escalation(helm: Path, scope: str) -> None:
    docs = render(helm, {"rbac": {"scope": scope}})
    for role in (d for d in docs if d["kind"] in ("Role", "ClusterRole")):
        for group, resource, verb, _ in permissions(role["rules"]):
            assert "*" not in (group, resource, verb)
            assert resource != "secrets", "the operator only references Secrets by name"
            assert verb not in ("escalate", "bind", "impersonate")


def leader_election_permissions() -> set[Permission]:
    """What leader election needs, from its code: the Lease requests in k8s/lease.py (the
    generated client's `*_namespaced_lease` methods) on the one Lease the Deployment names,
    and the takeover Event (handlers/leadership.py)."""
    lease_code = (OPERATOR_CODE / "k8s" / "lease.py").read_text()
    verbs = {"read": "get", "create": "create", "replace": "update"}
    used = set(re.findall(r"\.(\w+)_namespaced_lease\(", lease_code))
    assert used == set(verbs), used
    name = ("dynamo-operator-leader",)
    need: set[Permission] = {
        ("coordination.k8s.io", "leases", verbs[m], () if m == "create" else name) for m in used
    }
    assert "recorder.record(" in (OPERATOR_CODE / "handlers" / "leadership.py").read_text()
    need.add(("events.k8s.io", "events", "create", ()))
    return need


@pytest.mark.parametrize("scope", ["cluster", "namespaced"])
def test_leader_election_grants_exactly_its_lease_in_the_release_namespace(
    helm: Path, scope: str
) -> None:
    docs = render(helm, {"rbac": {"scope": scope}}, namespace="ops")
    role = one(docs, "Role", "dynamo-operator-leader-election")
    assert role["metadata"]["namespace"] == "ops"
    assert permissions(role["rules"]) == leader_election_permissions()
    binding = one(docs, "RoleBinding", "dynamo-operator-leader-election")
    assert binding["metadata"]["namespace"] == "ops"
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "dynamo-operator", "namespace": "ops"}
    ]
    # The Lease the operator is told to use is the one the Role names.
    assert cli._parser().parse_args(container(docs)["args"]).lease_name == "dynamo-operator-leader"


def test_rbac_create_false_renders_no_rbac(helm: Path) -> None:
    docs = render(helm, {"rbac": {"create": False}})
    assert not [d for d in docs if d["kind"].endswith(("Role", "RoleBinding"))]


# -- the CRDs -------------------------------------------------------------------------------


def test_chart_crd_templates_are_current() -> None:
    stale = crd.stale_chart_files(CHART)
    assert not stale, f"templates/crds/ is stale ({', '.join(stale)}): run hack/gen-crds"
    # Only the generated templates live there, and the chart has no `crds/` folder (Helm
    # would install those once and never upgrade them).
    names = {p.name for p in (CHART / crd.CHART_CRD_DIR).iterdir()}
    assert names == set(crd.chart_crd_files())
    assert not (CHART / "crds").exists()


def _bare(manifest: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(manifest)
    out["metadata"] = {"name": manifest["metadata"]["name"]}
    return out


def test_rendered_crds_are_the_generated_ones(helm: Path) -> None:
    docs = render(helm)
    rendered = {d["metadata"]["name"]: d for d in docs if d["kind"] == "CustomResourceDefinition"}
    # `helm template` cannot look the cluster up, so upstream's CRD is always rendered here.
    assert {name: _bare(d) for name, d in rendered.items()} == {
        c["metadata"]["name"]: _bare(c) for c in crd.all_crds()
    }
    for name, doc in rendered.items():
        annotations = doc["metadata"].get("annotations") or {}
        assert annotations.get("helm.sh/resource-policy") == "keep", name
        assert doc["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    upstream = rendered[f"{dwm.PLURAL}.{dwm.GROUP}"]["metadata"]["annotations"]
    assert upstream == crd.dynamo_worker_metadata_crd()["metadata"]["annotations"]


def test_crd_values(helm: Path) -> None:
    docs = render(helm, {"crds": {"keep": False}})
    for doc in (d for d in docs if d["kind"] == "CustomResourceDefinition"):
        kept = (doc["metadata"].get("annotations") or {}).get("helm.sh/resource-policy")
        # Upstream's DynamoWorkerMetadata is always kept: other components may use it.
        assert kept == ("keep" if doc["spec"]["group"] == dwm.GROUP else None)
    docs = render(helm, {"crds": {"install": False}})
    assert not [d for d in docs if d["kind"] == "CustomResourceDefinition"]


def test_chart_templates_escape_template_delimiters() -> None:
    manifest = crd.custom_resource_definition(crd.LoRAAdapter)
    manifest["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["description"] = "a {{ b }}"
    text = crd.chart_template(manifest)
    assert 'a {{ "{{" }} b }}' in text


# -- NOTES and Chart.yaml --------------------------------------------------------------------


def test_notes_point_at_examples_that_exist() -> None:
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    paths = set(re.findall(r"examples/[\w.-]+\.yaml", notes))
    assert paths, "NOTES.txt tells the user what to apply next"
    for path in paths:
        assert (REPO / path).is_file(), f"NOTES.txt names {path}, which does not exist"


def test_chart_metadata() -> None:
    chart = yaml.safe_load((REPO / "helm" / "dynamo-operator" / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["kubeVersion"] == ">=1.30.0-0"
    annotations = chart["annotations"]
    assert annotations["artifacthub.io/license"] == "Apache-2.0"
    listed = {c["name"] for c in yaml.safe_load(annotations["artifacthub.io/crds"])}
    assert listed == {c["metadata"]["name"] for c in crd.all_crds()}
    for example in yaml.safe_load(annotations["artifacthub.io/crdsExamples"]):
        resource = {"DynamoWorker": crd.DynamoWorker, "LoRAAdapter": crd.LoRAAdapter}
        resource[example["kind"]].model_validate(example)
    assert yaml.safe_load(annotations["artifacthub.io/links"])
