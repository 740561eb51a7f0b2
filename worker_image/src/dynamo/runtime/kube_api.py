"""The worker's client of the Kubernetes API server (discovery records, admin-route reviews).

In a pod with a mounted service-account token the worker talks as that account; elsewhere
(tests, laptops) it uses `$KUBECONFIG`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kubernetes_asyncio import client, config

SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


def in_cluster(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process runs in a pod with its service-account token mounted."""
    return bool(environ.get("KUBERNETES_SERVICE_HOST")) and os.path.exists(SERVICE_ACCOUNT_TOKEN)


async def api_client(environ: Mapping[str, str] = os.environ) -> client.ApiClient:
    """A new API client: the pod's service account in a pod, else `$KUBECONFIG`."""
    cfg = client.Configuration()
    if in_cluster(environ):
        config.load_incluster_config(client_configuration=cfg)
    else:
        await config.load_kube_config(
            config_file=environ.get("KUBECONFIG"), client_configuration=cfg
        )
    return client.ApiClient(cfg)
