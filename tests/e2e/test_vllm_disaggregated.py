"""Disaggregated serving with vLLM on the CPU: our prefill worker and our decode worker
(`dynamo-worker --engine vllm --disaggregation-mode ...`, each with vLLM's NixlConnector, NIXL
over UCX moving the KV cache DRAM to DRAM) behind upstream Dynamo's frontend (ai-dynamo 1.6.1)
with file discovery, on loopback.

A greedy prompt longer than two KV blocks must give exactly what an aggregated worker gives;
and the transfer must really have happened (a silently skipped prefill would give the same
text): the prefill worker served the request, and on the decode worker vLLM counted prompt
tokens from external KV transfer and NIXL counted bytes. A request cancelled while it decodes
frees its blocks on both workers. A request that reaches the decode worker without a prefill
result is prefilled there. A prefill worker killed (SIGKILL) after it answered and before
the decode worker pulled its blocks fails that request only: the decode worker answers an
error, does not hang, frees the request's slot and blocks and counts the failed transfer; a
prefill worker restarted on the same side channel then serves the pair again. A prefill
worker stopped (SIGTERM) before the decode worker pulled its blocks waits for the pull, so
that request still completes. Skipped without the venvs of `hack/vllm-venv` and
`hack/oracle-venv`.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from support import vllm
from support.testbed_workers import metric_sum
from support.tiny_model import TINY_MODEL_SEED, load_generator
from support.upstream import UpstreamFleet, free_port, upstream_fleet

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
__all__ = ["upstream_fleet"]

SERVED = "tiny-llama"
# KV blocks of 32 tokens (vLLM's CPU default is 128): a short prompt spans several.
BLOCK = 32
ENGINE_ARGS = (*vllm.CPU_ENGINE_ARGS, "--block-size", str(BLOCK))
ROLE_CONFIG = {"prefill": "kv_producer", "decode": "kv_consumer"}
# UCX between the two workers as between two Kubernetes pods: TCP. Such pods have their own
# IPC and PID namespaces, so UCX cannot use its shared-memory or CMA transports between them
# as it does between two processes of one host (where a killed prefill worker crashed the
# decode worker's vLLM process: see the guide's Limits).
UCX_AS_BETWEEN_PODS = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


async def complete(url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as response:
            answer = await response.json()
        assert response.status == 200, answer
    return answer


async def generate(url: str, body: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """A token-level request on a worker's own request plane: the status and the chunks."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session,
        session.post(url + "/v1/generate", json=body) as response,
    ):
        text = await response.text()
    return response.status, [json.loads(line) for line in text.splitlines() if line.strip()]


def role_worker(
    python: Path,
    model: Path,
    log: Path,
    role: str,
    discovery: dict[str, str],
    side_channel: int,
) -> vllm.Served:
    config = json.dumps({"kv_connector": "NixlConnector", "kv_role": ROLE_CONFIG[role]})
    return vllm.start_our_worker(
        python,
        model,
        log,
        "--disaggregation-mode",
        role,
        served_name=SERVED,
        engine_args=(*ENGINE_ARGS, "--kv-transfer-config", config),
        # Both workers share loopback: each its own NIXL side channel port.
        env={
            **discovery,
            **vllm.CPU_SHARING_ENV,
            **UCX_AS_BETWEEN_PODS,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel),
        },
    )


async def test_prefill_on_one_worker_decode_on_the_other(
    upstream_fleet: UpstreamFleet, tmp_path_factory: pytest.TempPathFactory
) -> None:
    python = vllm.vllm_python_or_skip()
    fleet = upstream_fleet
    root = tmp_path_factory.mktemp("vllm-disagg")
    load_generator().write_tiny_model(root / "model", TINY_MODEL_SEED, head_dim=64)
    model = root / "model" / "base"

    # The reference: an aggregated worker, alone (two vLLM engines are enough for 2 cores).
    reference = vllm.start_our_worker(
        python, model, root / "agg.log", served_name=SERVED, engine_args=ENGINE_ARGS
    )
    fleet.processes.append(reference.process)
    await vllm.wait_ready(reference)
    prompt = [(31 * n) % 400 + 10 for n in range(2 * BLOCK + 5)]
    expected = (await complete(reference.url, prompt, 12))["choices"][0]["text"]
    reference.process.stop()

    await fleet.start_frontend()
    discovery = {
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(fleet.kv),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_TCP_RPC_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
    }
    side_channels = {role: free_port() for role in ROLE_CONFIG}
    workers = {
        role: role_worker(python, model, root / f"{role}.log", role, discovery, side_channels[role])
        for role in ROLE_CONFIG
    }
    fleet.processes.extend(worker.process for worker in workers.values())
    for worker in workers.values():
        await vllm.wait_ready(worker)
    await fleet.wait_models(SERVED, within=120)
    await fleet.wait_prefill_router()
    cards = [json.loads(p.read_text()) for p in (fleet.kv / "v1" / "mdc").iterdir()]
    assert {card["card_json"]["worker_type"] for card in cards} == {"prefill", "decode"}
    assert {card["card_json"]["kv_cache_block_size"] for card in cards} == {BLOCK}

    prefill, decode = workers["prefill"].system_url, workers["decode"].system_url
    served_before = await metric_sum(prefill, "dynamo_component_requests_total")
    answer = await complete(fleet.frontend_url, prompt, 12)
    assert answer["choices"][0]["text"] == expected, fleet.logs()
    # Again: now a prefix-cache hit on both workers, which then move only the last block.
    again = await complete(fleet.frontend_url, prompt, 12)
    assert again["choices"][0]["text"] == expected, fleet.logs()
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    # The transfer really happened.
    assert await metric_sum(prefill, "dynamo_component_requests_total") == served_before + 2
    received = await metric_sum(
        decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )
    assert received >= 2 * BLOCK
    assert await metric_sum(decode, "vllm:nixl_bytes_transferred_sum") > 0

    # Asked directly, without a prefill result, the decode worker prefills the prompt itself,
    # as upstream's does.
    alone = await complete(workers["decode"].url, prompt, 12)
    assert alone["choices"][0]["text"] == expected, fleet.logs()
    assert (
        await metric_sum(
            decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
        )
        == received
    )

    # Cancelled while decoding: both workers free the request's blocks.
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 400, "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(fleet.frontend_url + "/v1/completions", json=body) as response,
    ):
        assert response.status == 200
        chunks = 0
        async for line in response.content:
            chunks += line.startswith(b"data:")
            if chunks == 3:
                break
    for url in (decode, prefill):
        await freed(url, fleet)

    # The prefill worker killed after it answered and before the decode worker pulled the
    # blocks. Each is asked on its own request plane, as the frontend would ask it, so that
    # no frontend timeout ends the request for it: the decode worker itself must answer.
    fresh = [(37 * n) % 400 + 10 for n in range(2 * BLOCK + 5)]
    code, out = await generate(
        workers["prefill"].url, {"token_ids": fresh, "stop_conditions": {"max_tokens": 1}}
    )
    assert code == 200, out
    handed = out[0]["disaggregated_params"]
    assert handed["kv_transfer_params"], out
    for process in process_tree(workers["prefill"]):
        process.kill()
    failed_before = await metric_sum(decode, "vllm:nixl_num_failed_transfers_total")
    body = {
        "token_ids": fresh,
        "stop_conditions": {"max_tokens": 12},
        "prefill_result": {"disaggregated_params": handed},
    }
    code, out = await asyncio.wait_for(generate(workers["decode"].url, body), 60)
    # vLLM's kv_load_failure_policy "fail": an error, not a hang and not made-up tokens.
    assert code == 200, out
    assert out[-1]["finish_reason"].startswith("error: "), out
    assert "KV cache" in out[-1]["finish_reason"], out
    assert not any(chunk.get("token_ids") for chunk in out), out
    assert await metric_sum(decode, "vllm:nixl_num_failed_transfers_total") > failed_before
    await freed(decode, fleet)

    # The prefill worker restarted on the same side channel (a pod's container restart keeps
    # its address): the pair serves again, its first pull from the new engine included.
    workers["prefill"] = role_worker(
        python, model, root / "prefill-again.log", "prefill", discovery, side_channels["prefill"]
    )
    fleet.processes.append(workers["prefill"].process)
    await vllm.wait_ready(workers["prefill"])
    prefill = workers["prefill"].system_url
    received = await metric_sum(
        decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )
    # The frontend may still route to the killed worker until its record expires (10 s).
    deadline = time.monotonic() + 60
    while await metric_sum(prefill, "dynamo_component_requests_total") == 0:
        assert time.monotonic() < deadline, fleet.logs()
        try:
            answer = await complete(fleet.frontend_url, prompt, 12)
        except AssertionError:
            await asyncio.sleep(0.5)
            continue
        assert answer["choices"][0]["text"] == expected, fleet.logs()
    # The decode worker pulled from the new engine (the blocks it did not cache itself).
    assert (
        await metric_sum(
            decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
        )
        > received
    )

    # SIGTERM to the prefill worker while the decode worker has yet to pull a request's blocks
    # (it is frozen): the prefill worker's drain waits for the pull, then exits.
    decode_tree = process_tree(workers["decode"])
    for process in decode_tree:
        process.send_signal(signal.SIGSTOP)
    try:
        served = await metric_sum(prefill, "dynamo_component_requests_total")
        request = asyncio.create_task(complete(fleet.frontend_url, prompt[::-1], 12))
        prefilled_by = time.monotonic() + 60
        while await metric_sum(prefill, "dynamo_component_requests_total") == served:
            assert not request.done(), fleet.logs()
            assert time.monotonic() < prefilled_by, fleet.logs()
            await asyncio.sleep(0.1)
        stopping = workers["prefill"].process
        stopping.process.send_signal(signal.SIGTERM)
        # Without the wait the prefill worker (grace period 0) stops its engine at once, and
        # the pull below fails. The decode worker stays frozen for less than the frontend's
        # 5 s request-plane timeout.
        await asyncio.sleep(2)
        assert stopping.process.poll() is None, fleet.logs()
    finally:
        for process in decode_tree:
            process.send_signal(signal.SIGCONT)
    answer = await asyncio.wait_for(request, 60)
    assert answer["usage"]["completion_tokens"] == 12
    assert await asyncio.to_thread(stopping.process.wait, 60) == 0


def process_tree(worker: vllm.Served) -> list[psutil.Process]:
    """A worker process and every process it started (vLLM's engine core and workers)."""
    root = psutil.Process(worker.process.process.pid)
    return [root, *root.children(recursive=True)]


async def freed(system_url: str, fleet: UpstreamFleet) -> None:
    """Wait (at most 60 s) until the worker runs no request and holds no KV block."""
    deadline = time.monotonic() + 60
    while await metric_sum(system_url, "vllm:num_requests_running") or await metric_sum(
        system_url, "vllm:kv_cache_usage_perc"
    ):
        assert time.monotonic() < deadline, (system_url, fleet.logs())
        await asyncio.sleep(0.2)
