"""spec.model.cache against the real API server, with the operator as a process and pods on
the fake nodes (which run nothing, so no fill ever completes here; the fill itself runs on
the kubelet node in tests/e2e/test_model_cache_on_node.py):

- the operator makes the claim and the fill Job, reports ModelCached=False, and makes no
  Deployment while the fill has not completed;
- spec.model.cache removed: the Deployment is made, and the claim and the fill Job go.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamo_operator.reconcile.dynamoworker.labels import fill_job_name, model_cache_claim_name
from dynamo_operator.reconcile.dynamoworker.model_cache import cache_key
from support.cluster import Cluster, eventually
from support.dynamo_workers import (
    GROUP,
    PLURAL,
    VERSION,
    condition,
    create_worker,
    get_worker,
    status_is_current,
)
from support.operator_process import running_operator

pytestmark = pytest.mark.cluster

SOURCE = "s3://models/tiny"
MERGE_PATCH: dict[str, Any] = {"_content_type": "application/merge-patch+json"}


async def _exists(read: Any, *args: str) -> bool:
    try:
        found = await read(*args)
    except ApiException as err:
        if err.status == 404:
            return False
        raise
    return found.metadata.deletion_timestamp is None


async def test_no_pods_before_the_fill_and_the_cache_goes_with_the_spec(
    api: client.ApiClient, cluster: Cluster, namespace: str, crds: None, tmp_path: Path
) -> None:
    apps, batch, core = client.AppsV1Api(api), client.BatchV1Api(api), client.CoreV1Api(api)
    claim, job = model_cache_claim_name("llm"), fill_job_name("llm", cache_key(SOURCE))
    spec = {"model": {"name": "tiny", "source": SOURCE, "cache": {"size": "1Gi"}}}
    with running_operator(cluster, [namespace], tmp_path / "operator.log") as operator:
        try:
            await create_worker(api, namespace, "llm", spec)

            async def cached() -> dict[str, Any]:
                return condition(await get_worker(api, namespace, "llm"), "ModelCached")

            waiting = await eventually(cached, 60, lambda c: c.get("status") == "False")
            assert waiting["reason"] in ("Filling", "VolumeUnavailable"), waiting
            worker = await get_worker(api, namespace, "llm")
            assert condition(worker, "Ready")["reason"] == "WaitingForModelCache"
            assert worker["status"]["modelCache"]["claimName"] == claim
            assert await _exists(core.read_namespaced_persistent_volume_claim, claim, namespace)
            filling = await batch.read_namespaced_job(job, namespace)
            (container,) = filling.spec.template.spec.containers
            assert container.command[:2] == ["dynamo-model-cache", "fill"]
            assert not await _exists(apps.read_namespaced_deployment, "llm", namespace)

            # Without the cache: the pods download for themselves, the cache's children go.
            unset = {"spec": {"model": {"cache": None}}}
            await client.CustomObjectsApi(api).patch_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, "llm", unset, **MERGE_PATCH
            )
            await eventually(
                lambda: _exists(apps.read_namespaced_deployment, "llm", namespace), 60, bool
            )
            await eventually(
                lambda: _exists(batch.read_namespaced_job, job, namespace), 60, (False).__eq__
            )
            await eventually(
                lambda: _exists(core.read_namespaced_persistent_volume_claim, claim, namespace),
                60,
                (False).__eq__,
            )
            # The children can be gone before the pass that removed them writes status.
            worker = await eventually(
                lambda: get_worker(api, namespace, "llm"), 60, status_is_current
            )
            assert "modelCache" not in worker["status"]
            assert condition(worker, "ModelCached") == {}
        except AssertionError as err:
            raise AssertionError(f"{err}\noperator log:\n{operator.log_tail()}") from None
