"""`SampleEngine`: deterministic synthetic output, aborts, LoRA, data-parallel metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dynamo.common.backend import ComponentSnapshot, GenerateRequest
from dynamo.common.forward_pass_metrics import ForwardPassMetrics
from dynamo.common.lora import LoRAManager
from dynamo.engines.lora_host import LORA_UPDATES
from dynamo.engines.sample import SampleEngine, SampleEngineArgs
from dynamo.runtime.context import Context
from support.lora_adapters import adapter_files, lora_env, write_tree

pytestmark = pytest.mark.unit
__all__ = ["lora_env"]


@pytest.fixture
async def engine() -> AsyncIterator[SampleEngine]:
    sample = SampleEngine(SampleEngineArgs(max_tokens=8), lora_manager=LoRAManager())
    await sample.start(123)
    yield sample
    await sample.cleanup()


async def collect(
    engine: SampleEngine, request: GenerateRequest, context: Context | None = None
) -> list[dict[str, Any]]:
    return [dict(chunk) async for chunk in engine.generate(request, context or Context())]


def tokens(chunks: list[dict[str, Any]]) -> list[int]:
    return [token for chunk in chunks for token in chunk["token_ids"]]


async def test_output_is_deterministic_and_bounded(engine: SampleEngine) -> None:
    request: GenerateRequest = {"token_ids": [1, 5, 6], "stop_conditions": {"max_tokens": 5}}
    first = await collect(engine, request)
    second = await collect(engine, dict(request))  # type: ignore[arg-type]
    assert tokens(first) == tokens(second)
    assert len(tokens(first)) == 5
    assert [chunk.get("finish_reason") for chunk in first] == [None] * 4 + ["length"]
    assert first[-1]["completion_usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "total_tokens": 8,
    }
    other = await collect(engine, {"token_ids": [1, 5, 7], "stop_conditions": {"max_tokens": 5}})
    assert tokens(other) != tokens(first)
    default = await collect(engine, {"token_ids": [1]})
    assert len(tokens(default)) == 8  # --max-tokens
    assert engine.tokenizer is not None
    assert all(
        char in "abcdefghijklmnopqrstuvwxyz " for char in engine.tokenizer.decode(tokens(first))
    )


async def test_concurrent_requests_interleave(engine: SampleEngine) -> None:
    requests = [{"token_ids": [1, i], "stop_conditions": {"max_tokens": 6}} for i in range(4)]
    results = await asyncio.gather(*(collect(engine, r) for r in requests))  # type: ignore[arg-type]
    assert all(len(tokens(chunks)) == 6 for chunks in results)


async def test_abort_ends_with_cancelled() -> None:
    engine = SampleEngine(SampleEngineArgs(token_delay=0.05, max_tokens=1000))
    await engine.start(1)
    try:
        context = Context("req-a")
        stream = engine.generate({"token_ids": [1]}, context)
        first = await anext(stream)
        assert first.get("finish_reason") is None
        await engine.abort(context)
        rest = [chunk async for chunk in stream]
        assert rest[-1]["finish_reason"] == "cancelled"
        assert engine.aborted == ["req-a"]
        # A stopped context ends the same way without an explicit abort.
        stopped = Context()
        stream = engine.generate({"token_ids": [2]}, stopped)
        await anext(stream)
        stopped.stop_generating()
        assert [chunk async for chunk in stream][-1]["finish_reason"] == "cancelled"
        assert await engine.is_quiescent() is True
    finally:
        await engine.cleanup()
        await engine.cleanup()


async def test_cleanup_cancels_running_requests() -> None:
    engine = SampleEngine(SampleEngineArgs(token_delay=0.05, max_tokens=1000))
    await engine.start(1)
    stream = engine.generate({"token_ids": [1]}, Context())
    await anext(stream)
    await engine.cleanup()
    assert [chunk async for chunk in stream][-1]["finish_reason"] == "cancelled"
    with pytest.raises(RuntimeError, match="not running"):
        await anext(engine.generate({"token_ids": [1]}, Context()))


async def test_adapter_output_differs_from_base(engine: SampleEngine, lora_env: Path) -> None:
    assert engine.supported_updates() >= LORA_UPDATES
    path = write_tree(lora_env / "adapters" / "a", adapter_files(1))
    loaded = await engine.engine_update(
        "load_lora", {"lora_name": "my-lora", "source": {"uri": f"file://{path}"}}
    )
    assert loaded["status"] == "success"
    assert engine.adapter_paths == {"my-lora": path}
    request: GenerateRequest = {"token_ids": [1, 2, 3], "stop_conditions": {"max_tokens": 8}}
    base = tokens(await collect(engine, request))
    adapted = tokens(await collect(engine, {**request, "model": "my-lora"}))
    assert base != adapted
    assert tokens(await collect(engine, {**request, "model": "sample-model"})) == base
    with pytest.raises(ValueError, match="neither the served model nor a loaded LoRA"):
        await collect(engine, {**request, "model": "unknown"})
    listing = await engine.engine_update("list_loras", {})
    assert listing["loras"] == {"my-lora": loaded["lora_id"]}
    unknown = await engine.engine_update("flush_cache", {})
    assert unknown == {"status": "error", "message": "unsupported engine update: flush_cache"}
    await engine.engine_update("unload_lora", {"lora_name": "my-lora"})
    assert engine.adapter_paths == {}


async def test_data_parallel_snapshots_and_fpm() -> None:
    engine = SampleEngine(
        SampleEngineArgs(data_parallel_size=2, data_parallel_start_rank=4, total_kv_blocks=100)
    )
    assert engine.component_metrics_dp_ranks() == [4, 5]
    snapshots: list[ComponentSnapshot] = []
    fpm: list[ForwardPassMetrics] = []

    class Publisher:
        def publish(self, rank: int, snapshot: ComponentSnapshot) -> None:
            assert rank == snapshot.dp_rank
            snapshots.append(snapshot)

    config = await engine.start(99)
    engine.attach_snapshot_publisher(Publisher())
    engine.attach_forward_pass_metrics_sink(fpm.append)
    try:
        assert config.llm is not None
        assert (config.llm.data_parallel_size, config.llm.data_parallel_start_rank) == (2, 4)
        assert {snap.dp_rank for snap in snapshots} == {4, 5}  # initial snapshot per rank
        request = {"token_ids": list(range(40)), "stop_conditions": {"max_tokens": 3}}
        forced = {**request, "routing": {"dp_rank": 5}}
        await collect(engine, forced)  # type: ignore[arg-type]
        assert any(snap.dp_rank == 5 and snap.kv_used_blocks == 3 for snap in snapshots)
        assert all(snap.kv_total_blocks == 100 for snap in snapshots)
        busy = [m for m in fpm if m.wall_time > 0 or m.scheduled_requests.num_decode_requests]
        assert busy
        assert all(m.worker_id == "99" for m in busy)
        assert all(m.dp_rank == 5 for m in busy)
        assert busy[0].scheduled_requests.num_prefill_requests == 1
        assert busy[0].scheduled_requests.sum_prefill_tokens == 40
        assert any(m.scheduled_requests.num_decode_requests == 1 for m in busy)
        # Going idle sends one all-zero heartbeat per rank.
        for _ in range(100):
            if any(
                m.wall_time == 0 and m.scheduled_requests.num_prefill_requests == 0
                for m in fpm[-2:]
            ):
                break
            await asyncio.sleep(0.01)
        idle = [m for m in fpm if m.wall_time == 0.0]
        assert {m.dp_rank for m in idle} == {4, 5}
    finally:
        await engine.cleanup()


async def test_from_args_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_SAMPLE_TOKEN_DELAY", "0.01")
    monkeypatch.setenv("DYN_NAMESPACE", "team")
    monkeypatch.delenv("DYN_DISCOVERY_BACKEND", raising=False)
    engine, config = await SampleEngine.from_args(
        ["--served-model-name", "tiny", "--max-loras", "2"]
    )
    assert engine.args.token_delay == 0.01
    assert engine.args.max_loras == 2
    assert config.served_model_name == "tiny"
    assert config.namespace == "team"
    assert config.discovery_backend == "mem"
    with pytest.raises(SystemExit):
        await SampleEngine.from_args(["--data-parallel-size", "0"])
    monkeypatch.setenv("DYN_SAMPLE_TOKEN_DELAY", "slow")
    with pytest.raises(SystemExit):
        await SampleEngine.from_args([])
