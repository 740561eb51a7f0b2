"""Scale to zero on the kubelet node, with the images users install: the chart's operator
(namespaced RBAC: the chart's rules are all it has), worker pods and the activator in real
containers under the restricted Pod Security level and the workers' NetworkPolicies.

One DynamoWorker (minReplicas 0): it serves, goes to zero after its idle time, and a request
then sent to the worker Service (whose one ready address is the activator's) is held while a
new pod starts from the image, and answered.
"""

from __future__ import annotations

import time
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
    dynamo_worker,
    operator_release,
    s3_credentials,
    state,
)
from support.s3 import TESTBED_HOST, S3Server
from support.s3_sigv4 import sigv4_s3_server
from support.testbed_workers import service_addresses
from support.tiny_model import TinyModel

pytestmark = pytest.mark.e2e

WORKER = "napping"
SERVED = "tiny-napping"
BUCKET = "models"
# A real container start (an image of torch, a model fetched from S3) on 2 shared cores.
READY_WITHIN = 600


@pytest.fixture
def model_bucket(tiny_model: TinyModel, tmp_path: Path) -> Iterator[S3Server]:
    with sigv4_s3_server(tmp_path / "s3", TESTBED_HOST) as s3:
        s3.client().create_bucket(Bucket=BUCKET)
        s3.upload_dir(BUCKET, "base", tiny_model.base)
        yield s3


async def _pods(api: client.ApiClient, namespace: str, selector: str) -> list[Any]:
    listing = await client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=selector)
    return [p for p in listing.items if p.metadata.deletion_timestamp is None]


async def _replicas(api: client.ApiClient, namespace: str) -> int:
    worker = await client.CustomObjectsApi(api).get_namespaced_custom_object(
        GROUP, VERSION, namespace, "dynamoworkers", WORKER
    )
    return int(worker["spec"]["replicas"])


async def _chat(base: str) -> dict[str, Any]:
    body = {
        "model": SERVED,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    timeout = aiohttp.ClientTimeout(total=READY_WITHIN)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(f"{base}/v1/chat/completions", json=body) as answer,
    ):
        assert answer.status == 200, await answer.text()
        return dict(await answer.json())


@pytest.mark.timeout(2400)
async def test_a_request_at_zero_starts_a_real_pod_and_is_answered(
    api: client.ApiClient, testbed: Cluster, node_images: Images, model_bucket: S3Server
) -> None:
    async with operator_release(testbed, node_images) as release:
        watched = release.watched
        s3 = await s3_credentials(api, watched, model_bucket)
        spec = {
            "model": {"name": SERVED, "source": f"s3://{BUCKET}/base"},
            "replicas": 1,
            "engine": {"name": "transformers"},
            "resources": {"gpusPerPod": 0, "memory": "2Gi"},
            "credentials": {"s3": s3},
            "pod": ON_THE_NODE,
            "autoscaling": {
                "minReplicas": 0,
                "maxReplicas": 1,
                "targetInFlightPerPod": 4,
                "scaleToZeroAfterSeconds": 20,
                "holdTimeoutSeconds": READY_WITHIN,
                "activatorPod": ON_THE_NODE,
            },
        }
        await dynamo_worker(api, watched, WORKER, spec)
        worker_pods = f"dynamo.dev/worker={WORKER}"
        try:
            [address] = await eventually(
                lambda: service_addresses(api, watched, WORKER), READY_WITHIN, lambda a: len(a) == 1
            )
            before = await _chat(f"http://{address}:8000")
            # Idle: down to zero, and the Service's one ready address is the activator's.
            await eventually(lambda: _replicas(api, watched), 300, (0).__eq__)
            await eventually(lambda: _pods(api, watched, worker_pods), 300, lambda p: not p)
            [activator] = await _pods(api, watched, f"dynamo.dev/activator={WORKER}")
            assert activator.spec.security_context.run_as_non_root is True
            [address] = await eventually(
                lambda: service_addresses(api, watched, WORKER), 60, lambda a: len(a) == 1
            )
            assert address == activator.status.pod_ip
            started = time.monotonic()
            after = await _chat(f"http://{address}:8000")
            waited = time.monotonic() - started
        except AssertionError as err:
            raise AssertionError(f"{err}\n{state(testbed, release.home, watched)}") from None
        assert after["choices"][0]["message"] == before["choices"][0]["message"]
        assert await _replicas(api, watched) == 1
        print(f"\n[scale-to-zero on the kubelet node] answered after {waited:.0f} s at zero")
