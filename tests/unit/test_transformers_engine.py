"""`TransformersEngine` on the tiny random Llama: scheduling, decoding, stops, LoRA, metrics.

References are computed independently with transformers' and PEFT's own `generate`.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dynamo.common.backend import ComponentSnapshot, GenerateChunk, GenerateRequest
from dynamo.common.forward_pass_metrics import ForwardPassMetrics
from dynamo.common.lora import LoRAManager
from dynamo.engines.lora_host import LORA_UPDATES
from dynamo.engines.transformers_engine import (
    SamplingParams,
    TransformersEngine,
    TransformersEngineArgs,
    apply_penalties,
    sample_token,
)
from dynamo.runtime.context import Context
from dynamo.runtime.errors import RequestError
from dynamo.runtime.tokenizer import Tokenizer
from support.tiny_model import TinyModel

pytestmark = pytest.mark.unit

SERVED = "tiny-llama"
# "Hello, how are you?" and a second, different prompt.
PROMPT_TEXT = "Hello, how are you?"
OTHER_TEXT = "SELECT name FROM users WHERE id = 42"
N = 16
# A longer continuation, for a request that must outlive adapter changes.
LONG = 64


class FpmRecorder:
    """Collects the engine's forward-pass metrics."""

    def __init__(self) -> None:
        self.messages: list[ForwardPassMetrics] = []

    def __call__(self, metrics: ForwardPassMetrics) -> None:
        self.messages.append(metrics)

    def scheduled(self) -> list[int]:
        return [
            m.scheduled_requests.num_prefill_requests + m.scheduled_requests.num_decode_requests
            for m in self.messages
        ]


class SnapshotRecorder:
    """Collects `publish(rank, snapshot)` calls, as the runtime's SnapshotPublisher gets them."""

    def __init__(self) -> None:
        self.snapshots: list[ComponentSnapshot] = []
        self.expected_ranks = {0}

    def publish(self, dp_rank: int, snapshot: ComponentSnapshot) -> None:
        assert dp_rank == snapshot.dp_rank
        assert dp_rank in self.expected_ranks
        self.snapshots.append(snapshot)


def make_engine(model: Path, cache: Path, **overrides: Any) -> TransformersEngine:
    args = TransformersEngineArgs(
        model=str(model),
        served_model_name=SERVED,
        max_loras=overrides.pop("max_loras", 2),
        max_num_seqs=overrides.pop("max_num_seqs", 4),
        device="cpu",
        **overrides,
    )
    return TransformersEngine(args, lora_manager=LoRAManager(cache))


@pytest.fixture(scope="module")
async def engine(
    tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[TransformersEngine]:
    eng = make_engine(tiny_model.base, tmp_path_factory.mktemp("lora-cache"))
    await eng.start(worker_id=7)
    yield eng
    await eng.cleanup()


@pytest.fixture(scope="module")
def prompts(tiny_model: TinyModel) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model.base)
    return {"hello": tokenizer.encode(PROMPT_TEXT), "sql": tokenizer.encode(OTHER_TEXT)}


@pytest.fixture(scope="module")
def reference(tiny_model: TinyModel, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Greedy continuations (N tokens, stopping at EOS) from transformers/PEFT `generate`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def greedy(model: Any, prompt: list[int], tokens: int = N) -> list[int]:
        ids = torch.tensor([prompt])
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            do_sample=False,
        )
        return [int(t) for t in out[0, len(prompt) :]]

    result = {}
    base = AutoModelForCausalLM.from_pretrained(tiny_model.base).eval()
    for key, prompt in prompts.items():
        result[f"base/{key}"] = greedy(base, prompt)
    for adapter in ("sql-lora", "poet-lora"):
        fresh = AutoModelForCausalLM.from_pretrained(tiny_model.base)
        peft_model = PeftModel.from_pretrained(fresh, str(tiny_model.adapters[adapter])).eval()
        for key, prompt in prompts.items():
            result[f"{adapter}/{key}"] = greedy(peft_model, prompt)
        if adapter == "sql-lora":
            result[f"{adapter}/hello/{LONG}"] = greedy(peft_model, prompts["hello"], LONG)
    return result


def request(
    prompt: list[int],
    *,
    model: str = SERVED,
    max_tokens: int | None = N,
    stop: dict[str, Any] | None = None,
    sampling: dict[str, Any] | None = None,
) -> GenerateRequest:
    """A greedy request (unless `sampling` says otherwise) for `max_tokens` tokens."""
    stop = {"max_tokens": max_tokens, **(stop or {})}
    sampling = {"temperature": 0.0, **(sampling or {})}
    return {
        "token_ids": prompt,
        "model": model,
        "sampling_options": sampling,
        "stop_conditions": stop,
    }


async def run(
    engine: TransformersEngine, req: GenerateRequest, context: Any = None
) -> tuple[list[int], GenerateChunk]:
    tokens: list[int] = []
    last: GenerateChunk | None = None
    async for chunk in engine.generate(req, context if context is not None else Context()):
        tokens += chunk["token_ids"]
        last = chunk
    assert last is not None
    assert "finish_reason" in last
    return tokens, last


async def load(engine: TransformersEngine, name: str, path: Path) -> dict[str, Any]:
    body = {"lora_name": name, "source": {"uri": f"file://{path}"}}
    return await engine.engine_update("load_lora", body)


# ----- decoding ------------------------------------------------------------------------


async def test_greedy_output_is_deterministic_and_matches_transformers(
    engine: TransformersEngine, prompts: dict[str, list[int]], reference: dict[str, list[int]]
) -> None:
    first, last = await run(engine, request(prompts["hello"]))
    second, _ = await run(engine, request(prompts["hello"]))
    assert first == second == reference["base/hello"]
    assert len(set(first)) > 3  # the random model does not just repeat one token
    expected_reason = "stop" if first[-1] == 2 else "length"
    assert last["finish_reason"] == expected_reason
    assert last["completion_usage"] == {
        "prompt_tokens": len(prompts["hello"]),
        "completion_tokens": len(first),
        "total_tokens": len(prompts["hello"]) + len(first),
    }
    # Asked for, each token carries its log-probability.
    with_logprobs: Any = {**request(prompts["hello"]), "output_options": {"logprobs": 0}}
    chunks = [chunk async for chunk in engine.generate(with_logprobs, Context())]
    assert [t for chunk in chunks for t in chunk["token_ids"]] == first
    logprobs = [chunk["log_probs"][0] for chunk in chunks if chunk["token_ids"]]
    assert len(logprobs) == len(first)
    assert all(-math.inf < value <= 0.0 for value in logprobs)
    assert "log_probs" not in last


async def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(
    engine: TransformersEngine, prompts: dict[str, list[int]], reference: dict[str, list[int]]
) -> None:
    def sampled(seed: int, **more: Any) -> GenerateRequest:
        sampling = {"temperature": 1.0, "seed": seed, **more}
        return request(prompts["hello"], sampling=sampling, stop={"ignore_eos": True})

    a, _ = await run(engine, sampled(1))
    b, _ = await run(engine, sampled(1))
    c, _ = await run(engine, sampled(2))
    assert a == b
    assert a != c
    assert a != reference["base/hello"]
    top1, _ = await run(engine, sampled(3, top_k=1))
    greedy, _ = await run(engine, request(prompts["hello"], stop={"ignore_eos": True}))
    assert top1 == greedy


def test_sample_token_respects_top_k_and_top_p() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])
    generator = torch.Generator().manual_seed(0)
    top3 = {sample_token(logits, SamplingParams(1.0, 1.0, 3), generator) for _ in range(300)}
    assert top3 == {0, 1, 2}
    # The top token holds ~64% of the mass: top_p 0.5 leaves only it.
    top_p = {sample_token(logits, SamplingParams(1.0, 0.5, 0), generator) for _ in range(100)}
    assert top_p == {0}
    assert sample_token(logits, SamplingParams(temperature=0.0), generator) == 0
    with pytest.raises(RequestError, match=r"'top_p' must be in \(0, 1\]"):
        SamplingParams.from_options({"top_p": 0})


# ----- iteration-level scheduling ---------------------------------------------------------


async def test_concurrent_requests_share_iterations_and_match_their_solo_output(
    engine: TransformersEngine, prompts: dict[str, list[int]], reference: dict[str, list[int]]
) -> None:
    recorder = FpmRecorder()
    engine.attach_forward_pass_metrics_sink(recorder)
    arrivals: list[int] = []

    async def tracked(index: int, prompt: list[int]) -> list[int]:
        tokens = []
        req = request(prompt, stop={"ignore_eos": True})
        async for chunk in engine.generate(req, Context()):
            arrivals.append(index)
            tokens += chunk["token_ids"]
        return tokens

    try:
        results = await asyncio.gather(
            tracked(0, prompts["hello"]), tracked(1, prompts["sql"]), tracked(2, prompts["hello"])
        )
    finally:
        engine.attach_forward_pass_metrics_sink(None)
    solo_hello, _ = await run(engine, request(prompts["hello"], stop={"ignore_eos": True}))
    solo_sql, _ = await run(engine, request(prompts["sql"], stop={"ignore_eos": True}))
    assert results == [solo_hello, solo_sql, solo_hello]
    # All three were in one iteration, and their chunks interleaved.
    assert max(recorder.scheduled()) == 3
    assert arrivals.index(1) < len(arrivals) - 1 - arrivals[::-1].index(0)
    # One prefill per request, then one decode step per request per iteration.
    assert sum(m.scheduled_requests.num_prefill_requests for m in recorder.messages) == 3
    decode_steps = sum(m.scheduled_requests.num_decode_requests for m in recorder.messages)
    assert decode_steps == 3 * (N - 1)
    assert [m.counter_id for m in recorder.messages] == sorted(
        m.counter_id for m in recorder.messages
    )
    assert all(m.worker_id == "7" for m in recorder.messages)
    # Going idle sends one all-zero heartbeat.
    idle = recorder.messages[-1]
    assert idle.wall_time == 0.0
    assert recorder.scheduled()[-1] == 0


async def test_max_num_seqs_queues_the_rest(
    tiny_model: TinyModel, tmp_path: Path, prompts: dict[str, list[int]]
) -> None:
    eng = make_engine(tiny_model.base, tmp_path, max_num_seqs=2)
    recorder = FpmRecorder()
    eng.attach_forward_pass_metrics_sink(recorder)
    await eng.start(worker_id=1)
    try:
        reqs = [request(prompts["hello"], max_tokens=6, stop={"ignore_eos": True})] * 4
        results = await asyncio.gather(*(run(eng, r) for r in reqs))
    finally:
        await eng.cleanup()
    assert [len(tokens) for tokens, _ in results] == [6] * 4
    assert max(recorder.scheduled()) == 2
    queued = [m.queued_requests for m in recorder.messages]
    assert max(q.num_prefill_requests for q in queued) == 2
    assert max(q.sum_prefill_tokens for q in queued) == 2 * len(prompts["hello"])


# ----- cancellation ----------------------------------------------------------------------


async def test_abort_ends_the_request_promptly_as_cancelled(
    engine: TransformersEngine, prompts: dict[str, list[int]]
) -> None:
    context = Context()
    stream = engine.generate(
        request(prompts["hello"], max_tokens=400, stop={"ignore_eos": True}), context
    )
    first = await anext(stream)
    assert first["token_ids"]
    assert "finish_reason" not in first
    await engine.abort(context)
    started = time.monotonic()
    rest = [chunk async for chunk in stream]
    assert time.monotonic() - started < 1.0
    assert rest[-1]["finish_reason"] == "cancelled"
    assert rest[-1]["completion_usage"]["completion_tokens"] < 400
    assert await engine.is_quiescent()
    assert engine.kv_usage()[0] == 0


async def test_a_stopped_context_and_a_closed_stream_end_the_request(
    engine: TransformersEngine, prompts: dict[str, list[int]]
) -> None:
    context = Context()
    stream = engine.generate(
        request(prompts["hello"], max_tokens=400, stop={"ignore_eos": True}), context
    )
    await anext(stream)
    # The runtime's stop without an explicit abort: the scheduler sees it next iteration.
    context.stop_generating()
    chunks = [chunk async for chunk in stream]
    assert chunks[-1]["finish_reason"] == "cancelled"

    stream = engine.generate(
        request(prompts["hello"], max_tokens=400, stop={"ignore_eos": True}), Context()
    )
    await anext(stream)
    assert not await engine.is_quiescent()
    await stream.aclose()  # the consumer went away
    assert await engine.is_quiescent()


# ----- stop conditions -------------------------------------------------------------------


def _first_fresh_index(tokens: list[int], start: int) -> int:
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


async def test_stop_token_ids_and_min_tokens(
    engine: TransformersEngine, prompts: dict[str, list[int]]
) -> None:
    greedy, _ = await run(engine, request(prompts["hello"], stop={"ignore_eos": True}))
    k = _first_fresh_index(greedy, 3)
    tokens, last = await run(
        engine, request(prompts["hello"], stop={"stop_token_ids": [greedy[k]]})
    )
    assert tokens == greedy[: k + 1]
    assert last["finish_reason"] == "stop"
    # Upstream's field name stops too.
    tokens, _ = await run(
        engine, request(prompts["hello"], stop={"stop_token_ids_hidden": [greedy[k]]})
    )
    assert tokens == greedy[: k + 1]
    # Below min_tokens a stop token is never produced (it is masked, so the output diverges).
    tokens, _ = await run(
        engine,
        request(prompts["hello"], stop={"stop_token_ids": [greedy[0]], "min_tokens": 5}),
    )
    assert len(tokens) >= 5
    assert greedy[0] not in tokens[:4]
    assert tokens[0] != greedy[0]


async def test_eos_from_the_generation_config_stops_unless_ignored(
    tiny_model: TinyModel, tmp_path: Path, prompts: dict[str, list[int]], engine: TransformersEngine
) -> None:
    greedy, _ = await run(engine, request(prompts["hello"], stop={"ignore_eos": True}))
    k = _first_fresh_index(greedy, 2)
    model = shutil.copytree(tiny_model.base, tmp_path / "model")
    for name in ("config.json", "generation_config.json"):
        config = json.loads((model / name).read_text())
        config["eos_token_id"] = greedy[k]
        (model / name).write_text(json.dumps(config))
    eng = make_engine(model, tmp_path / "cache", context_length=len(prompts["hello"]) + 12)
    await eng.start(worker_id=2)
    try:
        tokens, last = await run(eng, request(prompts["hello"], max_tokens=12))
        assert (tokens, last["finish_reason"]) == (greedy[: k + 1], "stop")
        tokens, last = await run(
            eng, request(prompts["hello"], max_tokens=10, stop={"ignore_eos": True})
        )
        assert (tokens, last["finish_reason"]) == (greedy[:10], "length")
        # Without max_tokens the output runs to the context length (prompt + 12)...
        stop: dict[str, Any] = {"ignore_eos": True, "max_tokens": None}
        tokens, last = await run(eng, request(prompts["hello"], max_tokens=None, stop=stop))
        assert (tokens, last["finish_reason"]) == (greedy[:12], "length")
        # ... and asking for more than fits is a request error (400), as in vLLM.
        stop = {"ignore_eos": True, "max_tokens": 13}
        with pytest.raises(RequestError) as info:
            await run(eng, request(prompts["hello"], max_tokens=None, stop=stop))
        assert (info.value.param, info.value.code) == ("max_tokens", "context_length_exceeded")
        too_long = prompts["hello"] * 3
        with pytest.raises(RequestError, match="the context length is") as info:
            await run(eng, request(too_long))
        assert (info.value.param, info.value.code) == ("prompt", "context_length_exceeded")
    finally:
        await eng.cleanup()


async def test_bad_requests_are_refused_with_the_field_named(
    engine: TransformersEngine, prompts: dict[str, list[int]]
) -> None:
    with pytest.raises(ValueError, match="neither the served model 'tiny-llama'"):
        await run(engine, request(prompts["hello"], model="nope"))
    # Each refusal is a RequestError (400) naming the OpenAI field.
    refusals = [
        (request(prompts["hello"], sampling={"temperature": -1}), "temperature"),
        (request(prompts["hello"], sampling={"top_p": 2.0}), "top_p"),
        (request(prompts["hello"], max_tokens=0), "max_tokens"),
        (request([1, 10**6]), "prompt"),
        (request(prompts["hello"], sampling={"n": 2}), "n"),
        (request(prompts["hello"], sampling={"guided_decoding": {"json_object": True}}), None),
    ]
    for bad, param in refusals:
        with pytest.raises(RequestError) as info:
            await run(engine, bad)
        assert info.value.status == 400
        assert info.value.param == (param or "response_format"), info.value
    assert "not supported by this engine" in str(info.value)


# ----- LoRA ------------------------------------------------------------------------------


async def test_adapters_match_peft_run_concurrently_and_unload_to_base(
    engine: TransformersEngine,
    tiny_model: TinyModel,
    prompts: dict[str, list[int]],
    reference: dict[str, list[int]],
) -> None:
    assert engine.supported_updates() >= LORA_UPDATES
    loaded = await load(engine, "sql-lora", tiny_model.adapters["sql-lora"])
    assert loaded["status"] == "success", loaded
    assert (await load(engine, "poet-lora", tiny_model.adapters["poet-lora"]))["status"] == (
        "success"
    )
    try:
        # Full: the capacity bound holds.
        full = await load(engine, "chat-lora", tiny_model.adapters["chat-lora"])
        assert full["status"] == "error"
        assert full["message"] == "LoRA capacity exceeded: at most 2 adapter(s) may be loaded"
        listed = await engine.engine_update("list_loras", {})
        assert listed["count"] == 2
        assert set(listed["loras"]) == {"sql-lora", "poet-lora"}

        # Base and both adapters in the same iterations, each as PEFT computes it alone.
        names = ["sql-lora", SERVED, "poet-lora", "sql-lora"]
        keys = ["hello", "hello", "sql", "sql"]
        results = await asyncio.gather(
            *(run(engine, request(prompts[k], model=m)) for m, k in zip(names, keys, strict=True))
        )
        for (tokens, _), model, key in zip(results, names, keys, strict=True):
            ref_model = "base" if model == SERVED else model
            assert tokens == reference[f"{ref_model}/{key}"], (model, key)
        assert reference["sql-lora/hello"] != reference["base/hello"]
        assert reference["poet-lora/sql"] != reference["base/sql"]
    finally:
        for name in ("sql-lora", "poet-lora"):
            await engine.engine_update("unload_lora", {"lora_name": name})
    assert engine.adapter_names() == []
    tokens, _ = await run(engine, request(prompts["hello"]))
    assert tokens == reference["base/hello"]
    with pytest.raises(ValueError, match="nor a loaded LoRA adapter"):
        await run(engine, request(prompts["hello"], model="sql-lora"))


async def test_unload_and_hot_swap_leave_running_requests_on_their_adapter(
    engine: TransformersEngine,
    tiny_model: TinyModel,
    prompts: dict[str, list[int]],
    reference: dict[str, list[int]],
) -> None:
    long_reference = reference[f"sql-lora/hello/{LONG}"]
    assert len(long_reference) == LONG  # no EOS: the request outlives the swap and unload
    assert (await load(engine, "mine", tiny_model.adapters["sql-lora"]))["status"] == "success"
    try:
        stream = engine.generate(
            request(prompts["hello"], model="mine", max_tokens=LONG), Context()
        )
        tokens = (await anext(stream))["token_ids"]
        swapped = await load(engine, "mine", tiny_model.adapters["poet-lora"])
        assert swapped["status"] == "success"
        assert swapped["hot_swap"] is True
        # New requests get the new version at once; the running one keeps the old.
        after, _ = await run(engine, request(prompts["hello"], model="mine"))
        assert after == reference["poet-lora/hello"]
        unloaded = await engine.engine_update("unload_lora", {"lora_name": "mine"})
        assert unloaded["status"] == "success"
        assert engine.resident_adapter_versions() == 1  # the running request's version
        remaining = [chunk async for chunk in stream]
        assert len(remaining) > 1  # it was still running across the swap and the unload
        for chunk in remaining:
            tokens += chunk["token_ids"]
        assert tokens == long_reference
    finally:
        await engine.engine_update("unload_lora", {"lora_name": "mine"})
    assert engine.adapter_names() == []
    tokens, _ = await run(engine, request(prompts["hello"]))
    assert tokens == reference["base/hello"]
    # The last version left PEFT when its request finished (the deletion ran first).
    assert engine.resident_adapter_versions() == 0


async def test_an_adapter_peft_refuses_leaves_the_engine_serving(
    engine: TransformersEngine,
    tiny_model: TinyModel,
    tmp_path: Path,
    prompts: dict[str, list[int]],
    reference: dict[str, list[int]],
) -> None:
    bad = shutil.copytree(tiny_model.adapters["sql-lora"], tmp_path / "bad")
    config = json.loads((bad / "adapter_config.json").read_text())
    config["target_modules"] = ["no_such_proj"]
    (bad / "adapter_config.json").write_text(json.dumps(config))
    for first in (True, False):  # PEFT wraps the model on the first load, adds to it later
        if not first:
            assert (await load(engine, "good", tiny_model.adapters["sql-lora"]))["status"] == (
                "success"
            )
        result = await load(engine, "bad", bad)
        assert result["status"] == "error"
        assert result["message"].startswith("Failed to load LoRA adapter 'bad': ")
        assert "no_such_proj" in result["message"]
        tokens, _ = await run(engine, request(prompts["hello"]))
        assert tokens == reference["base/hello"]
    tokens, _ = await run(engine, request(prompts["hello"], model="good"))
    assert tokens == reference["sql-lora/hello"]
    await engine.engine_update("unload_lora", {"lora_name": "good"})
    assert engine.resident_adapter_versions() == 0


# ----- registration, metrics, lifecycle --------------------------------------------------


async def test_registration_kv_snapshots_and_health_payload(
    tiny_model: TinyModel, tmp_path: Path, prompts: dict[str, list[int]]
) -> None:
    eng = make_engine(tiny_model.base, tmp_path, kv_block_size=4, max_num_seqs=3)
    snapshots = SnapshotRecorder()
    assert eng.component_metrics_dp_ranks() == [0]
    eng.attach_snapshot_publisher(snapshots)
    config = await eng.start(worker_id=3)
    try:
        assert config.model == str(tiny_model.base)
        assert config.served_model_name == SERVED
        assert config.llm is not None
        assert config.llm.context_length == 512
        assert config.llm.kv_cache_block_size == 4
        assert config.llm.max_num_seqs == 3
        assert config.llm.total_kv_blocks == 3 * 512 // 4
        assert isinstance(eng.tokenizer, Tokenizer)

        prompt = prompts["hello"]
        await run(eng, request(prompt, max_tokens=8, stop={"ignore_eos": True}))
        used = [s.kv_used_blocks for s in snapshots.snapshots]
        # The step that makes the 7th token leaves the prompt and 6 tokens in the cache (the
        # 7th enters with the next step, which makes the 8th and last); then it is freed.
        assert max(used) == math.ceil((len(prompt) + 6) / 4)
        assert used[-1] == 0
        assert {s.kv_total_blocks for s in snapshots.snapshots} == {3 * 512 // 4}
        peak = next(s for s in snapshots.snapshots if s.kv_used_blocks == max(used))
        assert peak.gpu_cache_usage == pytest.approx(max(used) / (3 * 512 // 4))

        payload = await eng.health_check_payload()
        assert payload is not None
        tokens, last = await run(eng, payload)  # type: ignore[arg-type]
        hf_tokenizer: Any = eng.tokenizer
        assert payload["token_ids"] == [hf_tokenizer.bos_token_id]
        assert len(tokens) == 1
        assert last["finish_reason"] == "length"
    finally:
        await eng.cleanup()


async def test_data_parallel_ranks_schedule_and_report_separately(
    tiny_model: TinyModel, tmp_path: Path, prompts: dict[str, list[int]]
) -> None:
    eng = make_engine(tiny_model.base, tmp_path, data_parallel_size=2, data_parallel_start_rank=4)
    recorder, snapshots = FpmRecorder(), SnapshotRecorder()
    snapshots.expected_ranks = {4, 5}
    eng.attach_forward_pass_metrics_sink(recorder)
    eng.attach_snapshot_publisher(snapshots)
    assert eng.component_metrics_dp_ranks() == [4, 5]
    config = await eng.start(worker_id=5)
    try:
        assert config.llm is not None
        assert (config.llm.data_parallel_size, config.llm.data_parallel_start_rank) == (2, 4)
        plain = request(prompts["hello"], max_tokens=4, stop={"ignore_eos": True})
        # Two at once: the least-loaded placement puts one on each rank.
        results = await asyncio.gather(run(eng, plain), run(eng, plain))
        assert results[0][0] == results[1][0]
        assert {m.dp_rank for m in recorder.messages} == {4, 5}
        assert {s.dp_rank for s in snapshots.snapshots} == {4, 5}
        for rank in (4, 5):
            mine = [m for m in recorder.messages if m.dp_rank == rank]
            assert [m.counter_id for m in mine] == list(range(1, len(mine) + 1))
        # A router-forced rank is honoured; one outside this engine's ranks is ignored.
        recorder.messages.clear()
        forced = {**plain, "routing": {"dp_rank": 5}}
        await asyncio.gather(run(eng, forced), run(eng, forced))  # type: ignore[arg-type]
        assert {m.dp_rank for m in recorder.messages} == {5}
        assert max(recorder.scheduled()) == 2
        outside = {**plain, "routing": {"dp_rank": 9}}
        tokens, _ = await run(eng, outside)  # type: ignore[arg-type]
        assert tokens == results[0][0]
        assert eng.kv_usage() == (0, 2 * 4 * 512 // 16)
    finally:
        await eng.cleanup()


async def test_cleanup_cancels_in_flight_requests_and_is_idempotent(
    tiny_model: TinyModel, tmp_path: Path, prompts: dict[str, list[int]]
) -> None:
    eng = make_engine(tiny_model.base, tmp_path)
    await eng.start(worker_id=4)
    stream = eng.generate(
        request(prompts["hello"], max_tokens=400, stop={"ignore_eos": True}), Context()
    )
    await anext(stream)
    await eng.cleanup()
    chunks = [chunk async for chunk in stream]
    assert chunks[-1]["finish_reason"] == "cancelled"
    await eng.cleanup()
    with pytest.raises(RuntimeError, match="not started"):
        await run(eng, request(prompts["hello"]))


async def test_from_args_parses_flags_and_refuses_bad_ones(
    tiny_model: TinyModel, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(tiny_model.base), "--served-model-name", "tiny", "--max-loras", "3"]
    argv += ["--max-num-seqs", "5", "--kv-block-size", "32", "--device", "cpu"]
    eng, config = await TransformersEngine.from_args(argv)
    assert isinstance(eng, TransformersEngine)
    assert (eng.args.max_loras, eng.args.max_num_seqs, eng.args.kv_block_size) == (3, 5, 32)
    assert eng.args.device == "cpu"
    assert eng.lora_host.max_loras == 3
    assert (config.model_name, config.served_model_name) == (str(tiny_model.base), "tiny")

    with pytest.raises(SystemExit):
        await TransformersEngine.from_args(["--model", str(tiny_model.root / "missing")])
    assert "no config.json there" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        await TransformersEngine.from_args(["--model", str(tiny_model.base), "--max-num-seqs", "0"])
    assert "max_num_seqs (--max-num-seqs) must be >= 1, got 0" in capsys.readouterr().err


async def test_log_probabilities_come_from_the_logits(
    engine: TransformersEngine, prompts: dict[str, list[int]]
) -> None:
    """`output_options.logprobs: N`: each token's log probability and its N best
    alternatives, from the model's own distribution (greedy: the token is the best one)."""
    req = request(prompts["hello"], max_tokens=4)
    req["output_options"] = {"logprobs": 3}
    chunks = [chunk async for chunk in engine.generate(req, Context())]
    assert [len(chunk["log_probs"]) for chunk in chunks] == [1, 1, 1, 1]
    for chunk in chunks:
        (top,) = chunk["top_logprobs"]
        assert [alt["rank"] for alt in top] == [1, 2, 3]
        assert top[0]["token_id"] == chunk["token_ids"][0]
        assert math.isclose(top[0]["logprob"], chunk["log_probs"][0])
        assert top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]
        assert all(alt["logprob"] <= 0 for alt in top)
    # logprobs 0: the sampled token's alone.
    req["output_options"] = {"logprobs": 0}
    chunks = [chunk async for chunk in engine.generate(req, Context())]
    assert all("top_logprobs" not in chunk and len(chunk["log_probs"]) == 1 for chunk in chunks)


async def test_penalties_and_logit_bias_change_the_output(
    engine: TransformersEngine, prompts: dict[str, list[int]]
) -> None:
    greedy, _ = await run(engine, request(prompts["hello"], max_tokens=6))
    banned = greedy[0]
    biased, _ = await run(
        engine,
        request(prompts["hello"], max_tokens=6, sampling={"logit_bias": {str(banned): -100}}),
    )
    assert biased[0] != banned
    forced, _ = await run(
        engine, request(prompts["hello"], max_tokens=3, sampling={"logit_bias": {"7": 100}})
    )
    assert forced == [7, 7, 7]


def test_penalties_follow_vllms_definitions() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # Token 3 generated twice, token 1 once; the prompt does not count for these two.
    out = apply_penalties(logits, params, prompt=[0], output=[3, 3, 1])
    assert out.tolist() == [2.0, -1.0 - 0.25 - 0.5, 0.5, 3.0 - 0.5 - 0.5]
    # Repetition: over prompt and output, positive logits divided, negative multiplied.
    out = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])
    assert out.tolist() == [1.0, -2.0, 0.5, 3.0]
    biased = apply_penalties(logits, SamplingParams(logit_bias=((2, 10.0),)), [0], [])
    assert biased.tolist() == [2.0, -1.0, 10.5, 3.0]
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0], "the input is left alone"
