"""End to end: real `dynamo-worker --engine dynamo.engines.sample:SampleEngine` processes on
loopback, driven over HTTP like the operator and clients drive them."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.lora_adapters import adapter_files
from support.s3 import S3Server
from support.upstream import post_json
from support.worker_process import SAMPLE_ENGINE, WorkerFactory, WorkerProcess, worker_factory

pytestmark = pytest.mark.e2e
__all__ = ["worker_factory"]


def sample(*args: str) -> tuple[str, ...]:
    return ("--engine", SAMPLE_ENGINE, *args)


async def get_json(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.json(content_type=None)


async def sse(response: aiohttp.ClientResponse) -> list[Any]:
    events = []
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def test_health_goes_ready_and_text_routes_work(worker_factory: WorkerFactory) -> None:
    worker = worker_factory(*sample("--startup-delay", "1.5", "--served-model-name", "tiny"))
    await worker.wait_health(503)
    await worker.wait_health(200)
    http = worker.http_url()
    status, answer = await post_json(http + "/v1/completions", {"prompt": "hi", "max_tokens": 5})
    assert status == 200
    assert answer["model"] == "tiny"
    assert len(answer["choices"][0]["text"]) == 5
    # Deterministic: the same prompt gives the same text.
    _, again = await post_json(http + "/v1/completions", {"prompt": "hi", "max_tokens": 5})
    assert again["choices"][0]["text"] == answer["choices"][0]["text"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    status, answer = await post_json(http + "/v1/chat/completions", chat)
    assert status == 200
    assert answer["choices"][0]["message"]["role"] == "assistant"
    async with aiohttp.ClientSession() as session:
        async with session.post(
            http + "/v1/chat/completions", json={**chat, "stream": True}
        ) as response:
            events = await sse(response)
        async with session.post(
            http + "/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stream": True}
        ) as response:
            text_events = await sse(response)
    assert events[-1] == "[DONE]"
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert content == answer["choices"][0]["message"]["content"]
    streamed = "".join(e["choices"][0]["text"] for e in text_events[:-1])
    assert streamed == again["choices"][0]["text"]
    _, models = await get_json(http + "/v1/models")
    assert [m["id"] for m in models["data"]] == ["tiny"]
    worker.terminate()
    assert await worker.wait_exit() == 0


async def test_lora_lifecycle_from_s3(
    worker_factory: WorkerFactory, s3_server: S3Server, tmp_path: Path
) -> None:
    bucket = s3_server.new_bucket("loras")
    client = s3_server.client()
    for name in ("a", "b"):
        for file_name, content in adapter_files(seed=ord(name)).items():
            client.put_object(Bucket=bucket, Key=f"adapters/{name}/{file_name}", Body=content)
    env = {
        **s3_server.env,
        "AWS_ALLOW_HTTP": "true",
        "DYN_LORA_ENABLED": "true",
        "DYN_LORA_PATH": str(tmp_path / "cache"),
    }
    worker = worker_factory(*sample("--max-loras", "1"), env=env)
    await worker.wait_health(200)
    system, http = worker.system_url(), worker.http_url()
    load_a = {"lora_name": "adapter-a", "source": {"uri": f"s3://{bucket}/adapters/a"}}

    status, answer = await post_json(system + "/v1/loras", load_a)
    assert status == 200, answer
    assert answer["status"] == "success"
    assert answer["lora_name"] == "adapter-a"
    lora_id = answer["lora_id"]
    assert (tmp_path / "cache" / f"s3__{bucket}_adapters_a" / "adapter_config.json").is_file()

    status, listing = await get_json(system + "/v1/loras")
    assert status == 200
    assert listing == {
        "status": "success",
        "loras": {"adapter-a": lora_id},
        "count": 1,
        "sources": {"adapter-a": load_a["source"]},
    }
    _, models = await get_json(http + "/v1/models")
    assert [m["id"] for m in models["data"]] == ["sample-model", "adapter-a"]

    outputs = {}
    for model in ("sample-model", "adapter-a"):
        body = {"model": model, "prompt": "same", "max_tokens": 12}
        status, answer = await post_json(http + "/v1/completions", body)
        assert status == 200
        outputs[model] = answer["choices"][0]["text"]
    assert outputs["sample-model"] != outputs["adapter-a"]

    status, again = await post_json(system + "/v1/loras", load_a)
    assert status == 200
    assert again["message"] == "LoRA adapter 'adapter-a' already loaded"

    load_b = {"lora_name": "adapter-b", "source": {"uri": f"s3://{bucket}/adapters/b"}}
    status, full = await post_json(system + "/v1/loras", load_b)
    assert status == 500
    assert full["message"] == "LoRA capacity exceeded: at most 1 adapter(s) may be loaded"

    async with (
        aiohttp.ClientSession() as session,
        session.post(system + "/v1/loras", json={"source": {"uri": "s3://x/y"}}) as response,
    ):
        # Upstream's JSON-extractor rejection, before the engine is asked.
        assert response.status == 422
        assert await response.text() == (
            "Failed to deserialize the JSON body into the target type: missing field "
            "`lora_name` at line 1 column 31"
        )

    _, metadata = await get_json(system + "/metadata")
    assert any("adapter-a" in json.dumps(card) for card in metadata["model_cards"].values())

    async with (
        aiohttp.ClientSession() as session,
        session.delete(system + "/v1/loras/adapter-a") as response,
    ):
        assert response.status == 200
        assert (await response.json())["status"] == "success"
    _, listing = await get_json(system + "/v1/loras")
    assert listing["count"] == 0
    _, models = await get_json(http + "/v1/models")
    assert [m["id"] for m in models["data"]] == ["sample-model"]
    status, _ = await post_json(http + "/v1/completions", {"model": "adapter-a", "prompt": "x"})
    assert status == 404

    async with aiohttp.ClientSession() as session, session.get(system + "/metrics") as response:
        text = await response.text()
    values = {
        (s.name, s.labels.get("reason")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert values[("dynamo_component_lora_load_failures_total", "capacity")] == 1
    assert values[("dynamo_component_lora_downloaded_bytes_total", None)] > 0
    assert values[("dynamo_component_lora_adapters_loaded", None)] == 0
    worker.terminate()
    assert await worker.wait_exit() == 0


async def test_model_taints_round_trip(worker_factory: WorkerFactory) -> None:
    worker = worker_factory(*sample())
    await worker.wait_health(200)
    url = worker.system_url() + "/engine/update/model_taints"
    status, answer = await post_json(url, {"taints": ["team=a", "gpu=h100", "team=a"]})
    assert (status, answer) == (200, {"status": "ok", "taints": ["gpu=h100", "team=a"]})
    _, metadata = await get_json(worker.system_url() + "/metadata")
    assert "gpu=h100" in json.dumps(metadata)
    status, refused = await post_json(url, {"taints": ["dynamo.topology/zone=a"]})
    assert status == 500
    assert refused["error"] == "Handler error"
    assert "reserved prefix 'dynamo.topology/'" in refused["message"]
    status, cleared = await post_json(url, {"taints": []})
    assert (status, cleared) == (200, {"status": "ok", "taints": []})
    worker.terminate()
    assert await worker.wait_exit() == 0


async def stream_completion(http: str, max_tokens: int, started: asyncio.Event) -> list[Any]:
    body = {"prompt": "drain me", "max_tokens": max_tokens, "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(http + "/v1/completions", json=body) as response,
    ):
        assert response.status == 200
        events: list[Any] = []
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
                started.set()
        return events


async def test_sigterm_drains_streams_then_exits_zero(worker_factory: WorkerFactory) -> None:
    worker = worker_factory(
        *sample("--token-delay", "0.05", "--grace-period", "0.3"),
    )
    await worker.wait_health(200)
    http = worker.http_url()
    starts = [asyncio.Event() for _ in range(20)]
    streams = [asyncio.create_task(stream_completion(http, 40, s)) for s in starts]
    await asyncio.wait_for(asyncio.gather(*(s.wait() for s in starts)), 60)

    signalled = time.monotonic()
    worker.terminate()
    await worker.wait_health(503, within=5)
    assert time.monotonic() - signalled < 1.0, "/health must turn 503 within 1 s"

    # After the grace period new requests are refused with Retry-After.
    deadline = time.monotonic() + 10
    while True:
        async with (
            aiohttp.ClientSession() as session,
            session.post(http + "/v1/completions", json={"prompt": "x"}) as response,
        ):
            if response.status == 503:
                assert response.headers["Retry-After"]
                break
        assert time.monotonic() < deadline, "new requests were never refused"
        await asyncio.sleep(0.02)

    results = await asyncio.wait_for(asyncio.gather(*streams), 60)
    for events in results:
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert len("".join(e["choices"][0]["text"] for e in events[:-1])) == 40
    assert await worker.wait_exit() == 0
    assert "drain finished" in worker.log()


async def test_short_drain_timeout_cancels_the_rest(worker_factory: WorkerFactory) -> None:
    worker = worker_factory(
        *sample("--token-delay", "0.05", "--grace-period", "0", "--drain-timeout", "0.5")
    )
    await worker.wait_health(200)
    http = worker.http_url()
    starts = [asyncio.Event() for _ in range(3)]
    # Far more than the drain lets finish, within the sample engine's 4096-token context
    # (past it a request is a 400).
    streams = [asyncio.create_task(stream_completion(http, 4_000, s)) for s in starts]
    await asyncio.wait_for(asyncio.gather(*(s.wait() for s in starts)), 60)
    worker.terminate()
    results = await asyncio.wait_for(asyncio.gather(*streams), 60)
    for events in results:
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "cancelled"
    assert await worker.wait_exit() == 0


async def test_metrics_parse_with_per_rank_gauges(worker_factory: WorkerFactory) -> None:
    worker = worker_factory(*sample("--data-parallel-size", "2", "--data-parallel-start-rank", "2"))
    await worker.wait_health(200)
    await post_json(worker.http_url() + "/v1/completions", {"prompt": "x", "max_tokens": 3})
    async with (
        aiohttp.ClientSession() as session,
        session.get(worker.system_url() + "/metrics") as response,
    ):
        assert response.status == 200
        text = await response.text()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    for name in ("dynamo_component_total_blocks", "dynamo_component_gpu_cache_usage_percent"):
        ranks = {sample.labels["dp_rank"] for sample in families[name].samples}
        assert ranks == {"2", "3"}
        for sample_ in families[name].samples:
            assert set(sample_.labels) >= {
                "dynamo_namespace", "dynamo_component", "dynamo_endpoint", "worker_id",
                "model", "model_name", "dp_rank",
            }  # fmt: skip
    requests = families["dynamo_component_requests"].samples[0]
    assert requests.value == 1
    assert int(requests.labels["worker_id"], 16) > 0
    load = families["dynamo_component_model_load_time_seconds"].samples[0]
    assert load.value >= 0
    worker.terminate()
    assert await worker.wait_exit() == 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_forward_pass_metrics_reach_the_receiver(worker_factory: WorkerFactory) -> None:
    port = free_port()
    worker = worker_factory(*sample("--token-delay", "0.01"),
                            env={"DYN_FORWARDPASS_METRIC_PORT": str(port)})  # fmt: skip
    await worker.wait_health(200)
    receiver = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dynamo.common.recv_forward_pass_metrics",
        "--zmq-endpoint", f"tcp://127.0.0.1:{port}", "--max-messages", "3",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        # Keep the engine busy until the receiver has its three messages (PUB/SUB joins late).
        async def traffic() -> None:
            while True:
                await post_json(
                    worker.http_url() + "/v1/completions", {"prompt": "x", "max_tokens": 20}
                )

        pump = asyncio.create_task(traffic())
        stdout, _ = await asyncio.wait_for(receiver.communicate(), 60)
        pump.cancel()
    finally:
        if receiver.returncode is None:
            receiver.kill()
    messages = [json.loads(line) for line in stdout.decode().splitlines() if line.strip()]
    assert len(messages) == 3
    assert all(m["version"] == 1 and m["worker_id"] for m in messages)
    worker.terminate()
    assert await worker.wait_exit() == 0


def run_cli(*args: str) -> tuple[int, str]:
    import subprocess

    result = subprocess.run(
        [sys.executable, "-m", "dynamo.runtime.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return result.returncode, result.stderr


@pytest.mark.parametrize(
    ("args", "code", "reason"),
    [
        (("--http-port", "99999"), 2, "--http-port must be 0-65535"),
        (("--grace-period", "soon"), 2, "argument --grace-period: invalid float value"),
        (("--engine", "nope"), 2, "must be MODULE:CLASS"),
        (("--engine", "no.such.module:Engine"), 1, "cannot import no.such.module"),
        (("--engine", "dynamo.engines.sample:SampleTokenizer"), 1, "not a dynamo.common.backend"),
        (sample("--max-tokens", "0"), 2, "engine arguments:"),
        (sample("--bogus-flag"), 2, "unrecognized arguments: --bogus-flag"),
    ],
)
def test_bad_arguments_exit_with_one_line(args: tuple[str, ...], code: int, reason: str) -> None:
    returncode, stderr = run_cli(*args)
    assert returncode == code
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert reason in lines[0]


def test_help_is_complete() -> None:
    import subprocess

    result = subprocess.run(
        [sys.executable, "-m", "dynamo.runtime.cli", "--help"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0
    for flag in ("--engine", "--model", "--served-model-name", "--data-parallel-size",
                 "--data-parallel-start-rank", "--enable-lora", "--max-loras",
                 "--lora-cache-path", "--drain-timeout", "--grace-period", "--shutdown-timeout",
                 "DYN_PREFILL_DRAIN_TIMEOUT_S"):  # fmt: skip
        assert flag in result.stdout
    engine_help = subprocess.run(
        [sys.executable, "-m", "dynamo.runtime.cli", *sample(), "--", "--help"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert engine_help.returncode == 0
    assert "--token-delay" in engine_help.stdout


async def test_worker_process_helper_reports_a_dead_worker(worker_factory: WorkerFactory) -> None:
    worker: WorkerProcess = worker_factory("--engine", "no.such:Engine")
    with pytest.raises(AssertionError, match="never"):
        await worker.wait_health(200, within=60)
