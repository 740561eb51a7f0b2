"""The chart's RBAC for worker admin routes, installed for one test namespace, and a token
for an operator running outside the cluster.

Worker pods the operator makes check every change with a TokenReview and a
LocalSubjectAccessReview (dynamo.runtime.system.auth). `chart_worker_admin` renders the chart
(namespaced scope, watching `namespace`) with the real helm and applies, from its output, the
workers' token-review ClusterRole and binding and the operator's Role, bound to a
ServiceAccount `dynamo-operator` in the namespace; it yields a file holding that account's
token for the workers' audience, which `dynamo-operator run --worker-token-file` reads. So a
local operator (admin kubeconfig for the API) is authorized by workers exactly as the
chart's own operator is. The cluster-scoped objects are deleted on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamo_operator.pods.credentials import WORKER_ADMIN_AUDIENCE
from support.helm import documents, require_helm, template

OPERATOR_ACCOUNT = "dynamo-operator"
TOKEN_SECONDS = 3600


@asynccontextmanager
async def chart_worker_admin(
    api: client.ApiClient, namespace: str, directory: Path
) -> AsyncIterator[Path]:
    """See the module docstring; the token file is written under `directory`."""
    values = {"rbac": {"scope": "namespaced", "watchNamespaces": [namespace]}}
    release = f"e2e-{namespace}"
    rendered = template(require_helm(), values, release=release, namespace=namespace).stdout
    docs: list[Any] = [d for d in documents(rendered) if d["kind"] in ("Role", "ClusterRole")]
    review: Any = next(d for d in docs if d["metadata"]["name"].endswith("-worker-token-review"))
    operator_role: Any = next(
        d
        for d in docs
        if d["kind"] == "Role"
        and any("dynamoworkers/admin" in rule["resources"] for rule in d["rules"])
    )
    binding: Any = next(
        d
        for d in documents(rendered)
        if d["kind"] == "ClusterRoleBinding" and d["metadata"]["name"] == review["metadata"]["name"]
    )
    rbac = client.RbacAuthorizationV1Api(api)
    core = client.CoreV1Api(api)
    account: Any = {"metadata": {"name": OPERATOR_ACCOUNT}}
    await core.create_namespaced_service_account(namespace, account)
    await rbac.create_namespaced_role(namespace, operator_role)
    role_binding: Any = {
        "metadata": {"name": operator_role["metadata"]["name"]},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": operator_role["metadata"]["name"],
        },
        "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_ACCOUNT, "namespace": namespace}],
    }
    await rbac.create_namespaced_role_binding(namespace, role_binding)
    await rbac.create_cluster_role(review)
    try:
        await rbac.create_cluster_role_binding(binding)
        request: Any = {
            "spec": {"audiences": [WORKER_ADMIN_AUDIENCE], "expirationSeconds": TOKEN_SECONDS}
        }
        token = await core.create_namespaced_service_account_token(
            OPERATOR_ACCOUNT, namespace, request
        )
        path = directory / "worker-admin-token"
        path.write_text(token.status.token)
        yield path
    finally:
        with contextlib.suppress(ApiException):
            await rbac.delete_cluster_role_binding(binding["metadata"]["name"])
        with contextlib.suppress(ApiException):
            await rbac.delete_cluster_role(review["metadata"]["name"])
