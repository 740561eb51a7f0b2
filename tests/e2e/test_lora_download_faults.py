"""Worker-side faults during a LoRA download: real `dynamo-worker` processes (SampleEngine) on
loopback load an adapter of four safetensors files from a moto S3 server through a proxy that
can hold every object GET (`support.counting_proxy`), so a fault lands after the listing,
with the download's temp directory made and no object fetched yet.

- The worker process is SIGKILLed mid-download: the load's caller loses its connection (the
  operator reports the pod `WorkerUnreachable`), nothing is published, and a restarted
  worker on the same cache serves nothing until the load is retried, which succeeds.
- The S3 server stops mid-download: the load fails with the reason `download failed`,
  nothing is published or served, and once the server is back the retry succeeds.
- The LoRA cache volume is full: the cache is a tmpfs of a fixed size, which is what the
  kubelet mounts for an emptyDir with `medium: Memory` and a `sizeLimit` (a disk-backed
  emptyDir over its `sizeLimit` gets the pod evicted instead; the test bed's process node
  enforces neither, so the worker runs here with its cache on the tmpfs). The load fails
  with `download failed` and a message naming the full cache, the partial files are removed,
  and after the volume grows the retry succeeds.

In each case the published adapter, once there, holds exactly the uploaded files.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from moto.server import ThreadedMotoServer

from dynamo.common.lora.adapter import COMPLETE_MARKER
from support.counting_proxy import CountingProxy, counting_proxy
from support.lora_adapters import big_adapter_files, read_tree
from support.s3 import S3Server, start_s3_server
from support.worker_process import SAMPLE_ENGINE, WorkerFactory, WorkerProcess, worker_factory

pytestmark = pytest.mark.e2e
__all__ = ["worker_factory"]

PREFIX = "adapters/big"
ADAPTER_MIB = 8
FILES = big_adapter_files(ADAPTER_MIB, shards=4)


@pytest.fixture
def s3() -> Iterator[tuple[ThreadedMotoServer, S3Server, str]]:
    """A moto server of this test's own (a test stops it), with the adapter uploaded."""
    server, info = start_s3_server()
    bucket = info.new_bucket("faults")
    client = info.client()
    for name, content in FILES.items():
        client.put_object(Bucket=bucket, Key=f"{PREFIX}/{name}", Body=content)
    try:
        yield server, info, bucket
    finally:
        server.stop()


@pytest.fixture
def held(s3: tuple[ThreadedMotoServer, S3Server, str]) -> Iterator[CountingProxy]:
    """The proxy in front of the server, holding object GETs until `release_gets` is set."""
    with counting_proxy(s3[1].endpoint_url) as proxy:
        proxy.release_gets.clear()
        try:
            yield proxy
        finally:
            proxy.release_gets.set()


def start_worker(
    factory: WorkerFactory, s3: S3Server, proxy: CountingProxy, cache: Path
) -> WorkerProcess:
    env = {
        **s3.env,
        "AWS_ENDPOINT_URL": proxy.url,
        "AWS_ALLOW_HTTP": "true",
        "DYN_LORA_ENABLED": "true",
        "DYN_LORA_PATH": str(cache),
    }
    return factory("--engine", SAMPLE_ENGINE, env=env)


def load_body(bucket: str) -> dict[str, Any]:
    return {"lora_name": "big", "source": {"uri": f"s3://{bucket}/{PREFIX}"}}


async def request(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    timeout = aiohttp.ClientTimeout(total=120)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.request(method, url, json=body) as response,
    ):
        return response.status, await response.json(content_type=None)


async def served(worker: WorkerProcess) -> dict[str, int]:
    status, listing = await request("GET", worker.system_url() + "/v1/loras")
    assert status == 200, listing
    return dict(listing["loras"])


def entry(cache: Path, bucket: str) -> Path:
    return cache / f"s3__{bucket}_{PREFIX.replace('/', '_')}"


def assert_nothing_published(cache: Path, bucket: str) -> None:
    assert not entry(cache, bucket).exists(), "a partial download was published"


def in_flight(cache: Path) -> list[str]:
    """The temp directories of downloads (running, or left by a killed worker)."""
    return [p.name for p in cache.iterdir() if ".tmp." in p.name]


async def assert_retry_succeeds(worker: WorkerProcess, cache: Path, bucket: str) -> None:
    status, answer = await request("POST", worker.system_url() + "/v1/loras", load_body(bucket))
    assert (status, answer["status"]) == (200, "success"), answer
    assert "big" in await served(worker)
    published = read_tree(entry(cache, bucket))
    assert {k: v for k, v in published.items() if not k.startswith(".")} == FILES
    assert COMPLETE_MARKER in published
    assert in_flight(cache) == []


async def load_until_held(
    worker: WorkerProcess, proxy: CountingProxy, bucket: str
) -> asyncio.Task[tuple[int, Any]]:
    """Start the load on a ready `worker`; returns once its first object GET is held."""
    await worker.wait_health(200)
    load = asyncio.create_task(
        request("POST", worker.system_url() + "/v1/loras", load_body(bucket))
    )
    assert await asyncio.to_thread(proxy.object_get_seen.wait, 60), "the download never began"
    return load


async def test_a_worker_killed_mid_download_publishes_nothing_and_retries(
    worker_factory: WorkerFactory,
    s3: tuple[ThreadedMotoServer, S3Server, str],
    held: CountingProxy,
    tmp_path: Path,
) -> None:
    _, info, bucket = s3
    cache = tmp_path / "cache"
    worker = start_worker(worker_factory, info, held, cache)
    load = await load_until_held(worker, held, bucket)
    assert in_flight(cache), "no download in flight"
    worker.process.send_signal(signal.SIGKILL)
    with pytest.raises(aiohttp.ClientConnectionError):
        await load
    await worker.wait_exit()
    held.release_gets.set()
    assert_nothing_published(cache, bucket)

    again = start_worker(worker_factory, info, held, cache)
    await again.wait_health(200)
    assert await served(again) == {}
    await assert_retry_succeeds(again, cache, bucket)


async def test_the_s3_server_stopping_mid_download_fails_with_a_reason_and_retries(
    worker_factory: WorkerFactory,
    s3: tuple[ThreadedMotoServer, S3Server, str],
    held: CountingProxy,
    tmp_path: Path,
) -> None:
    server, info, bucket = s3
    cache = tmp_path / "cache"
    worker = start_worker(worker_factory, info, held, cache)
    load = await load_until_held(worker, held, bucket)
    host, port = server.get_host_and_port()
    server.stop()
    held.release_gets.set()
    status, answer = await load
    assert status != 200, answer
    assert (answer["status"], answer["reason"]) == ("error", "download failed"), answer
    assert "big" not in await served(worker)
    assert_nothing_published(cache, bucket)

    # The same server again (moto keeps its buckets in this process), on the same port.
    back = ThreadedMotoServer(ip_address=host, port=port, verbose=False)
    back.start()
    try:
        await assert_retry_succeeds(worker, cache, bucket)
    finally:
        back.stop()


@dataclass
class SmallVolume:
    """A tmpfs of `mib` MiB at `path` (unmounted when the test ends)."""

    path: Path
    mib: int

    def grow(self, mib: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={mib}m", str(self.path)], check=True)
        self.mib = mib


@pytest.fixture
def small_cache(tmp_path: Path) -> Iterator[SmallVolume]:
    """A cache volume half the adapter's size."""
    if shutil.which("mount") is None:
        pytest.skip("no mount command to make a size-limited cache volume")
    volume = SmallVolume(tmp_path / "cache", ADAPTER_MIB // 2)
    volume.path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={volume.mib}m", "tmpfs", str(volume.path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for the cache (needs root): {mounted.stderr.strip()}")
    try:
        yield volume
    finally:
        subprocess.run(["umount", "-l", str(volume.path)], check=True)


async def test_a_full_cache_volume_fails_with_a_reason_and_retries_once_it_grows(
    worker_factory: WorkerFactory,
    s3: tuple[ThreadedMotoServer, S3Server, str],
    held: CountingProxy,
    small_cache: SmallVolume,
) -> None:
    _, info, bucket = s3
    held.release_gets.set()
    cache = small_cache.path
    worker = start_worker(worker_factory, info, held, cache)
    await worker.wait_health(200)
    status, answer = await request("POST", worker.system_url() + "/v1/loras", load_body(bucket))
    assert status != 200, answer
    assert (answer["status"], answer["reason"]) == ("error", "download failed"), answer
    assert "LoRA cache volume is full" in answer["message"], answer
    assert "big" not in await served(worker)
    assert_nothing_published(cache, bucket)
    assert in_flight(cache) == [], "the partial download was left behind"

    small_cache.grow(4 * ADAPTER_MIB)
    await assert_retry_succeeds(worker, cache, bucket)
