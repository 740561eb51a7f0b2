"""spec.model.cache end to end on the kubelet node, with the images users install: the chart's
operator fills a volume once by a Job, and worker pods start from it.

One DynamoWorker, in order:
- its Secret holds a wrong key: the fill fails with the credential reason, no worker pod is
  made, and status says what to fix;
- the Secret fixed (nothing deleted): the next fill completes, 2 pods become Ready from the
  cache, a chat completion answers;
- each model object was read from S3 exactly once, as the S3 server's own log counts it;
- the source changed: the new one fills beside the old, the pods roll onto it, and the old
  directory goes from the volume;
- scaled to 3, nothing more is read from S3.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client

from support.cluster import Cluster, eventually
from support.images import Images
from support.kubelet_release import (
    GROUP,
    ON_THE_NODE,
    VERSION,
    condition,
    dynamo_worker,
    operator_release,
    s3_credentials,
    state,
)
from support.s3 import TESTBED_HOST, S3Server
from support.s3_sigv4 import object_reads, sigv4_s3_server
from support.testbed_kubectl import kubectl
from support.tiny_model import TinyModel

# kubernetes_asyncio would send a JSON patch for a dict body.
MERGE_PATCH: dict[str, Any] = {"_content_type": "application/merge-patch+json"}
pytestmark = pytest.mark.e2e

WORKER = "cached"
SERVED = "tiny-cached"
BUCKET = "models"
PREFIX, NEW_PREFIX = "base", "base-v2"
# Two pods show that they share one fill as well as 4 did, at half the real container starts
# on 2 shared cores (each pod starts twice: once per source).
PODS = 2
# Real container starts on 2 shared cores: the fill, then the workers at once.
READY_WITHIN = 900


@pytest.fixture
def model_bucket(tiny_model: TinyModel, tmp_path: Path) -> Iterator[S3Server]:
    """The tiny model in the signature-checking S3 server, on the test bed's host address."""
    with sigv4_s3_server(tmp_path / "s3", TESTBED_HOST) as s3:
        s3.client().create_bucket(Bucket=BUCKET)
        for prefix in (PREFIX, NEW_PREFIX):
            s3.upload_dir(BUCKET, prefix, tiny_model.base)
        yield s3


def _model_objects(tiny_model: TinyModel, prefix: str = PREFIX) -> dict[str, int]:
    """Each object's key under `prefix`, with its size."""
    return {
        f"{prefix}/{p.relative_to(tiny_model.base).as_posix()}": p.stat().st_size
        for p in tiny_model.base.rglob("*")
        if p.is_file()
    }


async def _worker_pods(api: client.ApiClient, namespace: str) -> list[Any]:
    listing = await client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"dynamo.dev/worker={WORKER}"
    )
    return [p for p in listing.items if p.metadata.deletion_timestamp is None]


async def _status(api: client.ApiClient, namespace: str) -> dict[str, Any]:
    worker = await client.CustomObjectsApi(api).get_namespaced_custom_object(
        GROUP, VERSION, namespace, "dynamoworkers", WORKER
    )
    return dict(worker.get("status") or {})


def _is(status: str, reason: str | None = None) -> Any:
    def check(found: Any) -> bool:
        return found is not None and found["status"] == status and reason in (None, found["reason"])

    return check


async def _rolled_onto(api: client.ApiClient, namespace: str, old_key: str) -> bool:
    """Whether every pod runs the new source, Ready, with the old key's directory pruned."""
    status = await _status(api, namespace)
    cache = status.get("modelCache") or {}
    conditions = {c["type"]: c for c in status.get("conditions") or []}
    return (
        cache.get("key") not in (None, old_key)
        and "staleKey" not in cache
        and conditions.get("Progressing", {}).get("reason") == "RolloutComplete"
        and conditions.get("Ready", {}).get("status") == "True"
    )


async def _ready_replicas(api: client.ApiClient, namespace: str) -> int:
    return int((await _status(api, namespace)).get("readyReplicas") or 0)


async def _chat(url: str) -> dict[str, Any]:
    body = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as answer:
        assert answer.status == 200, await answer.text()
        return dict(await answer.json())


@pytest.mark.timeout(2400)
async def test_weights_are_fetched_once_per_cluster(
    api: client.ApiClient,
    testbed: Cluster,
    node_images: Images,
    model_bucket: S3Server,
    tiny_model: TinyModel,
) -> None:
    core = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    async with operator_release(testbed, node_images) as release:
        watched = release.watched
        try:
            s3 = await s3_credentials(api, watched, model_bucket)
            right_secret = (await core.read_namespaced_secret(s3["secretName"], watched)).data
            wrong = {"AWS_SECRET_ACCESS_KEY": "bm90LXRoZS1rZXk="}  # base64 of "not-the-key"
            await core.patch_namespaced_secret(
                s3["secretName"], watched, {"data": wrong}, **MERGE_PATCH
            )
            spec = {
                "model": {
                    "name": SERVED,
                    "source": f"s3://{BUCKET}/{PREFIX}",
                    "cache": {"size": "1Gi"},
                },
                "replicas": PODS,
                "engine": {"name": "transformers"},
                # No GPU: the kubelet node's 8 fake ones may still be held by an earlier
                # test's pods as they drain.
                "resources": {"gpusPerPod": 0, "memory": "2Gi"},
                "credentials": {"s3": s3},
                "pod": ON_THE_NODE,
            }
            await dynamo_worker(api, watched, WORKER, spec)

            # A wrong key: FillFailed with the credential reason, and no worker pod at all.
            cached = functools.partial(condition, api, watched, WORKER, "ModelCached")
            failed = await eventually(cached, 300, _is("False", "FillFailed"))
            assert "(auth)" in failed["message"], failed
            assert "tries again at" in failed["message"], failed
            degraded = await condition(api, watched, WORKER, "Degraded")
            assert _is("True", "FillFailed")(degraded), degraded
            assert await _worker_pods(api, watched) == []
            assert object_reads(model_bucket) == {}

            # Fixed in place: the operator's next try fills, and the pods start from the cache.
            await core.patch_namespaced_secret(
                s3["secretName"], watched, {"data": right_secret}, **MERGE_PATCH
            )
            await eventually(cached, 300, _is("True", "Ready"))
            status = await _status(api, watched)
            objects = _model_objects(tiny_model)
            assert status["modelCache"]["bytesTotal"] == sum(objects.values()), status
            ready = functools.partial(condition, api, watched, WORKER, "Ready")
            await eventually(ready, READY_WITHIN, _is("True"))

            # Each object was read from S3 once, for both pods.
            assert object_reads(model_bucket) == dict.fromkeys(objects, 1)
            pods = await _worker_pods(api, watched)
            assert len(pods) == PODS
            for pod in pods:
                volumes = {v.name: v for v in pod.spec.volumes}
                assert volumes["model-cache"].persistent_volume_claim.read_only is True
            answer = await _chat(f"http://{pods[0].status.pod_ip}:8000/v1/chat/completions")
            assert answer["choices"][0]["message"]["content"]

            # A new source: filled beside the old one, the pods roll onto it, the old goes.
            old_key = status["modelCache"]["key"]
            source = {"model": {"source": f"s3://{BUCKET}/{NEW_PREFIX}"}}
            await custom.patch_namespaced_custom_object(
                GROUP, VERSION, watched, "dynamoworkers", WORKER, {"spec": source}, **MERGE_PATCH
            )
            await eventually(lambda: _rolled_onto(api, watched, old_key), READY_WITHIN, bool)
            pods = await _worker_pods(api, watched)
            new_key = (await _status(api, watched))["modelCache"]["key"]
            listed = kubectl(
                testbed, "-n", watched, "exec", pods[0].metadata.name, "--",
                "ls", "-A", "/var/cache/dynamo/models",
            )  # fmt: skip
            assert listed.stdout.split() == [new_key], listed
            reads = dict.fromkeys(objects, 1) | dict.fromkeys(
                _model_objects(tiny_model, NEW_PREFIX), 1
            )
            assert object_reads(model_bucket) == reads

            # Scaled out: the new pods read the cache, not S3.
            await custom.patch_namespaced_custom_object(
                GROUP,
                VERSION,
                watched,
                "dynamoworkers",
                WORKER,
                {"spec": {"replicas": PODS + 1}},
                **MERGE_PATCH,
            )
            await eventually(lambda: _ready_replicas(api, watched), READY_WITHIN, (PODS + 1).__eq__)
            assert object_reads(model_bucket) == reads
        except AssertionError as err:
            raise AssertionError(f"{err}\n{state(testbed, release.home, watched)}") from None
