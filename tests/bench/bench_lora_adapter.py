"""LoRAAdapter figures on the test bed (run with `-m bench`): the time from creating a
LoRAAdapter to `Ready` on 4 worker pods (process-node pods running the sample engine, the
operator a subprocess), each as a ratio to one plain s3fs download of the same bytes from
the same loopback S3 server, measured in the same run:

* cold: a ~50 MiB adapter none of the pods has cached;
* warm: the same adapter again after deleting it (each pod's cache holds it);
* 20 at once: 20 distinct ~50 MiB adapters applied together (baseline: one plain download
  of all 20, i.e. one pod's worth of bytes; and the real floor, 4 plain downloads of all 20
  at once, since each of the 4 pods fetches its own copy through the one server).

Prints figures and plots the spread of the 20 adapters' apply -> Ready times against cold,
warm and the plain download (tests/support/bench_plots.py); asserts only that every adapter
became Ready on every pod. DYNAMO_BENCH_ADAPTERS and DYNAMO_BENCH_ADAPTER_MIB change the 20
and the 50 MiB.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamo_operator.k8s.client import Cluster as OperatorCluster
from dynamo_operator.reconcile.crds import install_crds
from support import bench_plots
from support.cluster import Cluster, eventually
from support.lora_adapters import big_adapter_files
from support.operator_namespace import serving_worker_spec
from support.operator_process import start_operator
from support.s3 import S3Server, testbed_s3_server
from support.worker_admin import chart_worker_admin

pytestmark = pytest.mark.bench
__all__ = ["testbed_s3_server"]

GROUP, VERSION = "dynamo.dev", "v1alpha1"
PODS = 4
MANY = int(os.environ.get("DYNAMO_BENCH_ADAPTERS", "20"))
ADAPTER_MIB = int(os.environ.get("DYNAMO_BENCH_ADAPTER_MIB", "50"))
MERGE: dict[str, Any] = {"_content_type": "application/merge-patch+json"}


def plain_download(s3: S3Server, bucket: str, prefixes: list[str], dest: Path) -> float:
    """Seconds for one s3fs copy of every object under `prefixes`."""
    from s3fs import S3FileSystem

    fs = S3FileSystem(
        skip_instance_cache=True,
        key=s3.env["AWS_ACCESS_KEY_ID"],
        secret=s3.env["AWS_SECRET_ACCESS_KEY"],
        endpoint_url=s3.endpoint_url,
    )
    started = time.perf_counter()
    for prefix in prefixes:
        fs.get(f"{bucket}/{prefix}/", str(dest / prefix) + "/", recursive=True)
    took = time.perf_counter() - started
    shutil.rmtree(dest, ignore_errors=True)
    return took


async def test_lora_adapter_figures(
    api: client.ApiClient,
    testbed: Cluster,
    testbed_s3_server: S3Server,
    tmp_path: Path,
) -> None:
    await install_crds(OperatorCluster(api))
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    namespace = f"b-lora-{uuid.uuid4().hex[:8]}"
    ns_body: Any = {"metadata": {"name": namespace, "labels": {"dynamo.dev/test": "true"}}}
    await core.create_namespace(ns_body)
    await eventually(lambda: core.read_namespaced_service_account("default", namespace), 30)
    s3 = testbed_s3_server
    bucket = s3.new_bucket("bench")
    files = big_adapter_files(total_mib=ADAPTER_MIB, shards=4)
    mib = sum(len(c) for c in files.values()) / 2**20
    s3_client = s3.client()
    prefixes = ["big", *(f"many-{i}" for i in range(MANY))]
    for prefix in prefixes:
        for name, content in files.items():
            s3_client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=content)
    secret: Any = {
        "metadata": {"name": "s3-creds"},
        "data": {
            key: base64.b64encode(b"testing").decode()
            for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
        },
    }
    await core.create_namespaced_secret(namespace, secret)
    # Workers admit the operator's loads only with a token the chart's RBAC authorizes.
    worker_admin = contextlib.AsyncExitStack()
    token = await worker_admin.enter_async_context(chart_worker_admin(api, namespace, tmp_path))
    operator = start_operator(
        testbed,
        [namespace],
        tmp_path / "operator.log",
        resync_seconds=5,
        extra_args=("--worker-token-file", str(token)),
    )
    try:
        await operator.wait_serving()
        worker: Any = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "DynamoWorker",
            "metadata": {"name": "bench"},
            "spec": serving_worker_spec(
                "/models/sample",
                PODS,
                max_loras=MANY + 2,
                s3={"secretName": "s3-creds", "endpoint": s3.endpoint_url},
            ),
        }
        await custom.create_namespaced_custom_object(
            GROUP, VERSION, namespace, "dynamoworkers", worker
        )

        async def ready_pods() -> int:
            listing = await core.list_namespaced_pod(
                namespace, label_selector="dynamo.dev/worker=bench"
            )
            return sum(
                1
                for p in listing.items
                if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
            )

        await eventually(ready_pods, 240, lambda n: n == PODS, every=0.5)

        async def create(name: str, prefix: str) -> None:
            body: Any = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "LoRAAdapter",
                "metadata": {"name": name},
                "spec": {
                    "workerRef": {"name": "bench"},
                    "source": {"uri": f"s3://{bucket}/{prefix}"},
                },
            }
            await custom.create_namespaced_custom_object(
                GROUP, VERSION, namespace, "loraadapters", body
            )

        def is_ready(obj: dict[str, Any]) -> bool:
            status = obj.get("status") or {}
            ready = [c for c in status.get("conditions") or [] if c["type"] == "Ready"]
            return bool(ready) and ready[0]["status"] == "True" and status["loaded"] == "4/4"

        async def timed(names: list[str], start: Callable[[], Any]) -> dict[str, float]:
            """Seconds from `start()` until each of `names` was seen Ready."""
            started = time.perf_counter()
            await start()
            pending = set(names)
            took: dict[str, float] = {}
            while pending:
                for name in list(pending):
                    obj = await custom.get_namespaced_custom_object(
                        GROUP, VERSION, namespace, "loraadapters", name
                    )
                    if is_ready(obj):
                        pending.discard(name)
                        took[name] = time.perf_counter() - started
                if time.perf_counter() - started > 600:
                    raise AssertionError(f"not Ready: {sorted(pending)}\n{operator.log_tail()}")
                await asyncio.sleep(0.05)
            return took

        async def delete(name: str) -> None:
            await custom.delete_namespaced_custom_object(
                GROUP, VERSION, namespace, "loraadapters", name
            )

            async def gone() -> bool:
                try:
                    await custom.get_namespaced_custom_object(
                        GROUP, VERSION, namespace, "loraadapters", name
                    )
                except ApiException as err:
                    return err.status == 404
                return False

            await eventually(gone, 60, bool)

        one = await asyncio.to_thread(plain_download, s3, bucket, ["big"], tmp_path / "dl")
        cold = (await timed(["big"], lambda: create("big", "big")))["big"]
        await delete("big")
        warm = (await timed(["big"], lambda: create("big", "big")))["big"]
        many_names = [f"many-{i}" for i in range(MANY)]
        all_bytes = await asyncio.to_thread(plain_download, s3, bucket, many_names, tmp_path / "dl")
        # The real floor: each pod fetches its own copy of all of them, all pods at once.
        copies = await asyncio.gather(
            *(
                asyncio.to_thread(plain_download, s3, bucket, many_names, tmp_path / f"dl-{i}")
                for i in range(PODS)
            )
        )
        floor = max(copies)
        each = await timed(
            many_names,
            lambda: asyncio.gather(*(create(n, n) for n in many_names)),
        )
        many = max(each.values())
        print(
            f"\nLoRAAdapter apply -> Ready on {PODS} pods, adapter {mib:.1f} MiB "
            f"(plain download {one:.2f}s, {mib / one:.0f} MiB/s):"
            f"\n  cold: {cold:.2f}s = {cold / one:.2f}x one plain download"
            f"\n  warm: {warm:.2f}s = {warm / one:.2f}x"
            f"\n  {MANY} adapters at once: {many:.2f}s = {many / all_bytes:.2f}x one plain "
            f"download of all {MANY} ({all_bytes:.2f}s; the pods fetch {PODS}x those bytes)"
            f" = {many / floor:.2f}x {PODS} parallel plain downloads of all {MANY}, the floor "
            f"({floor:.2f}s; goal <= 1.5x)"
        )
        bench_plots.distribution(
            list(each.values()),
            {
                "one adapter, cold": cold,
                "one adapter, warm": warm,
                "plain download of one": one,
                f"plain download of all {MANY}": all_bytes,
                f"{PODS} parallel plain downloads of all {MANY}": floor,
            },
            f"LoRAAdapter apply -> Ready on {PODS} pods ({mib:.0f} MiB each)",
            "bench-lora-apply-ready",
        )
    finally:
        operator.stop()
        listing = await custom.list_namespaced_custom_object(
            GROUP, VERSION, namespace, "loraadapters"
        )
        for item in listing["items"]:
            with _suppress():
                await custom.patch_namespaced_custom_object(
                    GROUP, VERSION, namespace, "loraadapters", item["metadata"]["name"],
                    {"metadata": {"finalizers": None}},
                    **MERGE,
                )  # fmt: skip
        with _suppress():
            await custom.patch_namespaced_custom_object(
                GROUP, VERSION, namespace, "dynamoworkers", "bench",
                {"metadata": {"finalizers": None}},
                **MERGE,
            )  # fmt: skip
        await core.delete_namespace(namespace)
        await worker_admin.aclose()


def _suppress() -> Any:
    import contextlib

    return contextlib.suppress(ApiException)
