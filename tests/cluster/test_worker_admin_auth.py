"""The worker's admin-route check against the test bed's real API server, with the RBAC the
worker really gets: the operator's worker Role (LocalSubjectAccessReview) and the chart's
token-review binding, rendered by helm in namespaced scope. Tokens are minted by the API
server (TokenRequest); the worker's own client speaks with its service account's token.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio import client, config

from dynamo.runtime.system import auth
from dynamo_operator.api import DynamoWorker
from dynamo_operator.reconcile.dynamoworker.builders import desired_role, desired_role_binding
from support.api_cases import dynamo_worker
from support.cluster import Cluster
from support.helm import documents, require_helm, template

pytestmark = pytest.mark.cluster

WORKER = "llm"


async def _token(api: client.ApiClient, namespace: str, account: str, audience: str | None) -> str:
    request: Any = {"spec": {"audiences": [audience] if audience else [], "expirationSeconds": 600}}
    answer = await client.CoreV1Api(api).create_namespaced_service_account_token(
        account, namespace, request
    )
    return str(answer.status.token)


async def _apply_rbac(api: client.ApiClient, docs: list[dict[str, Any]], namespace: str) -> None:
    rbac = client.RbacAuthorizationV1Api(api)
    for doc in docs:
        create = {
            "Role": lambda d: rbac.create_namespaced_role(namespace, d),
            "RoleBinding": lambda d: rbac.create_namespaced_role_binding(namespace, d),
            "ClusterRole": rbac.create_cluster_role,
            "ClusterRoleBinding": rbac.create_cluster_role_binding,
        }[doc["kind"]]
        await create(doc)


@pytest_asyncio.fixture
async def accounts(
    api: client.ApiClient, cluster: Cluster, namespace: str
) -> AsyncIterator[dict[str, str]]:
    """Service accounts `worker` (the operator's worker Role and binding, and the chart's
    token-review binding), `admin` (granted dynamoworkers/admin) and `nobody`."""
    core = client.CoreV1Api(api)
    manifest = dynamo_worker(WORKER)
    manifest["metadata"] |= {"namespace": namespace, "uid": str(uuid.uuid4())}
    dw = DynamoWorker.model_validate(manifest)
    role, binding = desired_role(dw), desired_role_binding(dw)
    for doc in (role, binding):
        doc["metadata"].pop("ownerReferences")  # no DynamoWorker object here
    worker_account = binding["subjects"][0]["name"]
    for name in (worker_account, "admin", "nobody"):
        account: Any = {"metadata": {"name": name}}
        await core.create_namespaced_service_account(namespace, account)
    release = f"auth-{namespace}"
    values = {"rbac": {"scope": "namespaced", "watchNamespaces": [namespace]}}
    chart = documents(template(require_helm(), values, release=release, namespace="ops").stdout)
    review = [d for d in chart if d["metadata"]["name"].endswith("-worker-token-review")]
    assert sorted(d["kind"] for d in review) == ["ClusterRole", "ClusterRoleBinding"]
    admin_role = {
        "metadata": {"name": "worker-admin"},
        "rules": [
            {"apiGroups": ["dynamo.dev"], "resources": ["dynamoworkers/admin"], "verbs": ["update"]}
        ],
    }
    admin_binding = {
        "metadata": {"name": "worker-admin"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "worker-admin",
        },
        "subjects": [{"kind": "ServiceAccount", "name": "admin", "namespace": namespace}],
    }
    await _apply_rbac(
        api,
        [
            {"kind": "Role", **role},
            {"kind": "RoleBinding", **binding},
            {"kind": "Role", **admin_role},
            {"kind": "RoleBinding", **admin_binding},
            *review,
        ],
        namespace,
    )
    try:
        yield {"worker": worker_account, "admin": "admin", "nobody": "nobody"}
    finally:
        rbac = client.RbacAuthorizationV1Api(api)
        for doc in review:
            name = doc["metadata"]["name"]
            if doc["kind"] == "ClusterRole":
                await rbac.delete_cluster_role(name)
            else:
                await rbac.delete_cluster_role_binding(name)


async def _as(cluster: Cluster, token: str) -> client.ApiClient:
    """An API client speaking with `token` (how the worker pod talks to the API server)."""
    admin = client.Configuration()
    await config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=admin)
    cfg = client.Configuration(host=admin.host)
    cfg.ssl_ca_cert = admin.ssl_ca_cert
    cfg.api_key = {"BearerToken": token}
    cfg.api_key_prefix = {"BearerToken": "Bearer"}
    return client.ApiClient(cfg)


async def test_tokens_are_reviewed_and_callers_authorized_by_the_api_server(
    api: client.ApiClient, cluster: Cluster, namespace: str, accounts: dict[str, str]
) -> None:
    worker_token = await _token(api, namespace, accounts["worker"], None)

    async def connect() -> client.ApiClient:
        return await _as(cluster, worker_token)

    check = auth.AdminAuth(auth.KubernetesReviewer(namespace, connect=connect), namespace, WORKER)
    try:
        admin = await _token(api, namespace, "admin", auth.AUDIENCE)
        allowed = await check.decide(f"Bearer {admin}")
        assert allowed.status == 200, allowed
        assert allowed.username == f"system:serviceaccount:{namespace}:admin"

        nobody = await _token(api, namespace, "nobody", auth.AUDIENCE)
        denied = await check.decide(f"Bearer {nobody}")
        assert denied.status == 403, denied
        assert f"system:serviceaccount:{namespace}:nobody may not change" in denied.message

        # The admin's ordinary token (the API server's audience) is not for workers.
        ordinary = await _token(api, namespace, "admin", None)
        wrong_audience = await check.decide(f"Bearer {ordinary}")
        assert wrong_audience.status == 401, wrong_audience

        assert (await check.decide("Bearer not-a-token")).status == 401
    finally:
        await check.close()


async def test_a_worker_without_its_role_cannot_authorize_and_says_so(
    api: client.ApiClient, cluster: Cluster, namespace: str, accounts: dict[str, str]
) -> None:
    """`nobody` may review tokens (the chart's binding covers its namespace) but has no
    LocalSubjectAccessReview: the check fails closed (503 from the server), naming the Role."""
    nobody_token = await _token(api, namespace, "nobody", None)

    async def connect() -> client.ApiClient:
        return await _as(cluster, nobody_token)

    check = auth.AdminAuth(auth.KubernetesReviewer(namespace, connect=connect), namespace)
    try:
        admin = await _token(api, namespace, "admin", auth.AUDIENCE)
        with pytest.raises(auth.ReviewUnavailable, match="localsubjectaccessreviews"):
            await check.decide(f"Bearer {admin}")
    finally:
        await check.close()
