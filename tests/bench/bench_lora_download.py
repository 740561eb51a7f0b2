"""LoRA download figures against the loopback moto S3 server (run with `-m bench`).

* cold: `download_lora` of a ~100 MiB adapter (4 safetensors files) into an empty cache,
  as a ratio to a plain s3fs copy of the same objects made in the same run (goal <= 1.2);
* warm: `download_lora` of the cached adapter, per call (goal <= 1 ms), with the number of
  requests that reached S3 (goal 0), counted by a proxy in front of the server.

Prints figures; asserts only that the downloads succeed and are byte-identical.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import time
from pathlib import Path

import pytest

from dynamo.common.lora import LoRAManager
from support.counting_proxy import counting_proxy
from support.lora_adapters import big_adapter_files, lora_env, read_tree
from support.s3 import S3Server

pytestmark = pytest.mark.bench
__all__ = ["lora_env"]

ROUNDS = 3
WARM_CALLS = 2000


def s3fs_copy(server: S3Server, bucket: str, names: list[str], dest: Path) -> None:
    """The baseline: a plain s3fs copy of the adapter's objects."""
    from s3fs import S3FileSystem

    fs = S3FileSystem(
        skip_instance_cache=True,
        key=server.env["AWS_ACCESS_KEY_ID"],
        secret=server.env["AWS_SECRET_ACCESS_KEY"],
        endpoint_url=server.endpoint_url,
    )
    dest.mkdir(parents=True)
    fs.get([f"{bucket}/lora/{n}" for n in names], [str(dest / n) for n in names])


def test_lora_download_figures(
    s3_server: S3Server, lora_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_server.apply_env(monkeypatch)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    files = big_adapter_files(total_mib=100, shards=4)
    total_mib = sum(len(c) for c in files.values()) / 2**20
    bucket = s3_server.new_bucket("bench")
    client = s3_server.client()
    for name, content in files.items():
        client.put_object(Bucket=bucket, Key=f"lora/{name}", Body=content)
    uri = f"s3://{bucket}/lora"
    names = sorted(files)

    ours: list[float] = []
    baseline: list[float] = []
    for round_ in range(ROUNDS):
        copy_dir = lora_env / f"copy{round_}"
        start = time.perf_counter()
        s3fs_copy(s3_server, bucket, names, copy_dir)
        baseline.append(time.perf_counter() - start)
        assert read_tree(copy_dir) == files
        shutil.rmtree(copy_dir)

        cache = lora_env / f"cache{round_}"
        manager = LoRAManager(cache)
        start = time.perf_counter()
        result = asyncio.run(manager.download_lora(uri))
        ours.append(time.perf_counter() - start)
        assert result["status"] == "success", result
        if round_ < ROUNDS - 1:
            shutil.rmtree(cache)

    assert read_tree(Path(result["local_path"])) == files | {".dynamo_lora_complete": b"1\n"}
    cold = statistics.median(ours)
    plain = statistics.median(baseline)

    async def warm_calls(manager: LoRAManager) -> list[float]:
        timings = []
        for _ in range(WARM_CALLS):
            start = time.perf_counter()
            warm = await manager.download_lora(uri)
            timings.append(time.perf_counter() - start)
            assert warm == result
        return timings

    with counting_proxy(s3_server.endpoint_url) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT", proxy.url)
        timings = asyncio.run(warm_calls(manager))
        warm_requests = len(proxy.requests)

    print()
    print(f"LoRA cold download, {total_mib:.0f} MiB in {len(files)} files, median of {ROUNDS}:")
    print(f"  download_lora   {cold:.3f} s  ({total_mib / cold:.0f} MiB/s)  runs {ours}")
    print(f"  plain s3fs get  {plain:.3f} s  ({total_mib / plain:.0f} MiB/s)  runs {baseline}")
    print(f"  ratio           {cold / plain:.2f}  (goal <= 1.2)")
    print(f"LoRA warm download_lora, {WARM_CALLS} calls:")
    print(
        f"  median {statistics.median(timings) * 1e3:.3f} ms, "
        f"p99 {sorted(timings)[int(0.99 * len(timings))] * 1e3:.3f} ms  (goal <= 1 ms)"
    )
    print(f"  requests to S3: {warm_requests}  (goal 0)")
