"""One download per URI at a time, across threads and across processes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from filelock import FileLock

from dynamo.common.lora import LoRAManager
from support.counting_proxy import CountingProxy, counting_proxy
from support.lora_adapters import big_adapter_files, lora_env, read_tree
from support.s3 import S3Server

pytestmark = pytest.mark.unit
__all__ = ["lora_env"]

FILES = big_adapter_files(total_mib=8, shards=4)

# Each child says "ready" just before it asks for the adapter, then prints the result.
CHILD = """
import asyncio, json, sys
from dynamo.common.lora import LoRAManager
manager = LoRAManager()
print("ready", flush=True)
print(json.dumps(asyncio.run(manager.download_lora(sys.argv[1]))), flush=True)
"""


@pytest.fixture
def proxied_s3(
    lora_env: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[CountingProxy, str]]:
    s3_server.apply_env(monkeypatch)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    bucket = s3_server.new_bucket("conc")
    client = s3_server.client()
    for name, content in FILES.items():
        client.put_object(Bucket=bucket, Key=f"lora/{name}", Body=content)
    with counting_proxy(s3_server.endpoint_url) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT", proxy.url)
        yield proxy, f"s3://{bucket}/lora"


def check_cache(lora_env: Path, uri: str, local_path: str) -> None:
    key = LoRAManager._uri_to_cache_key(uri)
    assert local_path == str(lora_env / "cache" / key)
    assert read_tree(Path(local_path)) == FILES | {".dynamo_lora_complete": b"1\n"}
    assert {p.name for p in (lora_env / "cache").iterdir()} == {key, f"{key}.lock"}


def test_two_processes_download_once(proxied_s3: tuple[CountingProxy, str], lora_env: Path) -> None:
    proxy, uri = proxied_s3
    manager = LoRAManager()
    lock = FileLock(str(manager.downloader.lock_path(manager._uri_to_cache_key(uri))))
    # Hold the URI's lock until both children are about to download, so they contend.
    lock.acquire()
    try:
        children = [
            subprocess.Popen(
                [sys.executable, "-c", CHILD, uri],
                stdout=subprocess.PIPE,
                text=True,
                env=dict(os.environ),
            )
            for _ in range(2)
        ]
        for child in children:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "ready"
    finally:
        lock.release()
    outputs = [child.communicate(timeout=300)[0] for child in children]
    assert [child.returncode for child in children] == [0, 0]
    results = [__import__("json").loads(out.strip().splitlines()[-1]) for out in outputs]
    assert [r["status"] for r in results] == ["success", "success"], results
    assert results[0] == results[1]
    assert proxy.object_gets() == len(FILES)  # each object fetched once in all
    check_cache(lora_env, uri, results[0]["local_path"])


def test_two_threads_download_once(proxied_s3: tuple[CountingProxy, str], lora_env: Path) -> None:
    proxy, uri = proxied_s3
    start = threading.Barrier(2)
    results: list[dict[str, str]] = []

    def run() -> None:
        start.wait()
        results.append(asyncio.run(LoRAManager().download_lora(uri)))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r["status"] for r in results] == ["success", "success"], results
    assert proxy.object_gets() == len(FILES)
    check_cache(lora_env, uri, results[0]["local_path"])


async def test_cancelled_download_leaves_nothing_and_frees_the_lock(
    proxied_s3: tuple[CountingProxy, str], lora_env: Path
) -> None:
    proxy, uri = proxied_s3
    manager = LoRAManager()
    key = manager._uri_to_cache_key(uri)
    proxy.release_gets.clear()  # object GETs wait at the proxy: the download is mid-way
    try:
        task = asyncio.create_task(manager.download_lora(uri))
        assert await asyncio.to_thread(proxy.object_get_seen.wait, 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        proxy.release_gets.set()
    # No temp dir, no half-written entry: only the lock file, and the lock is free.
    assert {p.name for p in (lora_env / "cache").iterdir()} == {f"{key}.lock"}
    assert not manager.is_cached(uri)
    lock = FileLock(str(manager.downloader.lock_path(key)))
    lock.acquire(timeout=0)  # raises filelock.Timeout if the cancelled download still held it
    lock.release()
    result = await manager.download_lora(uri)
    assert result["status"] == "success"
    check_cache(lora_env, uri, result["local_path"])
