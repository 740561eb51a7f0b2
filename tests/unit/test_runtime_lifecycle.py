"""`WorkerRuntime` in-process: startup, admin routes, discovery updates, shutdown order."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynamo.common.backend import (
    EngineConfig,
    GenerateRequest,
    LLMEngine,
    ModelInput,
    RawEngine,
    WorkerConfig,
)
from dynamo.common.constants import DisaggregationMode
from dynamo.common.lora import LoRAManager
from dynamo.engines.sample import SampleEngine, SampleEngineArgs
from dynamo.runtime.discovery.mem import MemBackend
from dynamo.runtime.lifecycle import WorkerRuntime, validate_config
from dynamo.runtime.settings import RuntimeSettings
from dynamo.runtime.watchdog import DeadlineWatchdog
from support.lora_adapters import adapter_files, lora_env, write_tree

pytestmark = pytest.mark.unit
__all__ = ["lora_env"]

SETTINGS = RuntimeSettings(
    system_host="127.0.0.1",
    system_port=0,
    http_host="127.0.0.1",
    http_port=0,
    grace_period_secs=0.0,
    lora_enabled=True,
)


class RecordingEngine(SampleEngine):
    """The sample engine, recording lifecycle calls in order."""

    def __init__(self, args: SampleEngineArgs, **kwargs: Any) -> None:
        super().__init__(args, **kwargs)
        self.calls: list[str] = []
        self.fail_start = False

    async def start(self, worker_id: int) -> EngineConfig:
        self.calls.append("start")
        if self.fail_start:
            raise RuntimeError("no GPU")
        return await super().start(worker_id)

    async def on_endpoint_ready(self, endpoint: Any) -> None:
        self.calls.append(f"endpoint_ready:{endpoint.path()}")

    async def cleanup(self) -> None:
        self.calls.append("cleanup")
        await super().cleanup()


def make_runtime(
    engine: SampleEngine, settings: RuntimeSettings = SETTINGS, **config: Any
) -> tuple[WorkerRuntime, MemBackend]:
    discovery = MemBackend()
    worker_config = WorkerConfig(namespace="test", discovery_backend="mem", **config)
    runtime = WorkerRuntime(engine, worker_config, settings, discovery=discovery, instance_id=0x1F)
    return runtime, discovery


async def until(condition: Any, what: str) -> None:
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


async def serving(runtime: WorkerRuntime) -> asyncio.Task[int]:
    task = asyncio.create_task(runtime.run())
    await until(lambda: runtime.health.is_healthy() or task.done(), "the worker to serve")
    if task.done():
        task.result()
    return task


def gauge(runtime: WorkerRuntime, name: str) -> float:
    for family in text_string_to_metric_families(runtime.metrics.exposition()):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} is not exposed")


def system_url(runtime: WorkerRuntime, path: str) -> str:
    return f"http://127.0.0.1:{runtime.system_port}{path}"


def http_url(runtime: WorkerRuntime, path: str) -> str:
    return f"http://127.0.0.1:{runtime.http_port}{path}"


async def test_startup_serving_and_shutdown(lora_env: Path) -> None:
    engine = RecordingEngine(SampleEngineArgs(model="m", served_model_name="served"),
                             lora_manager=LoRAManager())  # fmt: skip
    runtime, discovery = make_runtime(engine)
    task = await serving(runtime)
    async with aiohttp.ClientSession() as session:
        async with session.get(system_url(runtime, "/health")) as response:
            assert response.status == 200
        metadata = discovery.metadata()
        assert metadata is not None
        assert engine.calls == ["start", "endpoint_ready:test.backend.generate"]

        # A taint change is published.
        url = system_url(runtime, "/engine/update/model_taints")
        async with session.post(url, json={"taints": ["gpu=h100", "team=a", "gpu=h100"]}) as r:
            assert await r.json() == {"status": "ok", "taints": ["gpu=h100", "team=a"]}
        assert runtime.advertisement().runtime_config["taints"] == ["gpu=h100", "team=a"]
        assert discovery.history[-1][0] == "update"
        async with session.post(url, json={"taints": ["dynamo.topology/zone=a"]}) as r:
            assert r.status == 500
            assert "reserved prefix 'dynamo.topology/'" in (await r.json())["message"]

        # A LoRA load is published as an adapter card and listed.
        path = write_tree(lora_env / "adapters" / "x", adapter_files(4))
        body = {"lora_name": "x", "source": {"uri": f"file://{path}"}}
        async with session.post(system_url(runtime, "/v1/loras"), json=body) as r:
            assert r.status == 200, await r.text()
        advert = runtime.advertisement()
        assert [card.lora_name for card in advert.adapters] == ["x"]
        assert advert.adapters[0].source_uri == f"file://{path}"
        async with session.get(http_url(runtime, "/v1/models")) as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["served", "x"]

        runtime._on_signal(signal.SIGTERM)
        runtime._on_signal(signal.SIGTERM)  # a second signal changes nothing
        assert not runtime.health.is_healthy()
        assert await asyncio.wait_for(task, 30) == 0
    assert engine.calls.count("cleanup") == 1
    assert [what for what, _ in discovery.history][-2:] == ["unregister", "close"]
    assert gauge(runtime, "dynamo_component_model_load_time_seconds") >= 0


async def test_admin_routes_are_refused_while_shutting_down() -> None:
    engine = RecordingEngine(SampleEngineArgs(token_delay=0.05, max_tokens=40))
    settings = RuntimeSettings(**{**SETTINGS.__dict__, "grace_period_secs": 0.3})
    runtime, _ = make_runtime(engine, settings)
    task = await serving(runtime)
    async with aiohttp.ClientSession() as session:
        runtime._on_signal(signal.SIGTERM)
        url = system_url(runtime, "/engine/update/list_loras")
        async with session.post(url, json={}) as response:
            assert await response.json() == {
                "status": "error",
                "message": "engine administrative routes are unavailable while the worker is "
                "shutting down",
            }
        # During the grace period requests are still served.
        body = {"token_ids": [1], "stop_conditions": {"max_tokens": 2}}
        async with session.post(http_url(runtime, "/v1/generate"), json=body) as r:
            assert r.status == 200
    assert await asyncio.wait_for(task, 30) == 0


async def test_drain_lets_requests_finish_then_refuses_new() -> None:
    engine = RecordingEngine(SampleEngineArgs(token_delay=0.02))
    runtime, _ = make_runtime(engine)
    task = await serving(runtime)
    async with aiohttp.ClientSession() as session:
        body = {"token_ids": [1], "stop_conditions": {"max_tokens": 30}}
        async with session.post(http_url(runtime, "/v1/generate"), json=body) as response:
            await response.content.readline()
            runtime._on_signal(signal.SIGTERM)
            await until(lambda: not runtime.tracker.accepting, "the drain")
            async with session.post(http_url(runtime, "/v1/generate"), json=body) as refused:
                assert refused.status == 503
                assert refused.headers["Retry-After"] == "1"
            rest = [line async for line in response.content if line.strip()]
        assert b'"finish_reason":"length"' in rest[-1]
    assert await asyncio.wait_for(task, 30) == 0
    assert gauge(runtime, "dynamo_component_drain_time_seconds") > 0
    assert gauge(runtime, "dynamo_component_cleanup_time_seconds") >= 0
    # Everything finished within the budget: no drain timeout.
    assert gauge(runtime, "dynamo_worker_drain_timeouts_exceeded_total") == 0


async def test_drain_budget_cancels_the_rest() -> None:
    engine = RecordingEngine(SampleEngineArgs(token_delay=0.02, max_tokens=100_000))
    settings = RuntimeSettings(**{**SETTINGS.__dict__, "drain_timeout_secs": 0.2})
    runtime, _ = make_runtime(engine, settings)
    task = await serving(runtime)
    async with aiohttp.ClientSession() as session:
        body = {"prompt": "x", "stream": True}
        async with session.post(http_url(runtime, "/v1/completions"), json=body) as response:
            await response.content.readline()
            runtime._on_signal(signal.SIGTERM)
            lines = [line.decode().strip() async for line in response.content if line.strip()]
    assert lines[-1] == "data: [DONE]"
    assert '"finish_reason":"cancelled"' in lines[-2]
    assert await asyncio.wait_for(task, 30) == 0
    assert engine.calls.count("cleanup") == 1
    assert gauge(runtime, "dynamo_worker_drain_timeouts_exceeded_total") == 1


async def test_failed_start_still_cleans_up() -> None:
    engine = RecordingEngine(SampleEngineArgs())
    engine.fail_start = True
    runtime, _ = make_runtime(engine)
    with pytest.raises(RuntimeError, match="no GPU"):
        await runtime.run()
    assert engine.calls == ["start", "cleanup"]


async def test_signal_before_start_skips_the_engine() -> None:
    engine = RecordingEngine(SampleEngineArgs())
    runtime, _ = make_runtime(engine)
    runtime.signalled.set()
    assert await runtime.run() == 0
    assert engine.calls == []


async def test_prefill_drain_polls_quiescence() -> None:
    engine = RecordingEngine(SampleEngineArgs())
    runtime, _ = make_runtime(engine, disaggregation_mode=DisaggregationMode.PREFILL)
    task = await serving(runtime)
    assert runtime.advertisement().model_type == "Prefill"
    assert runtime.advertisement().worker_type == "prefill"
    runtime._on_signal(signal.SIGINT)
    assert await asyncio.wait_for(task, 30) == 0


async def test_system_server_disabled_and_token_budget_published() -> None:
    from dynamo.common.token_budget import TokenBudget

    engine = RecordingEngine(SampleEngineArgs())
    settings = RuntimeSettings(
        **{**SETTINGS.__dict__, "system_port": -1, "token_budget": TokenBudget(32, True, False)}
    )
    runtime, _ = make_runtime(engine, settings)
    task = await serving(runtime)
    assert runtime.system_port is None
    card_config = runtime.advertisement().runtime_config
    assert card_config["runtime_data"]["token_budget"] == {
        "combined_limit": 32,
        "reject_prompt_overflow": True,
        "reject_total_overflow": False,
    }
    assert card_config["data_parallel_size"] == 1
    assert card_config["max_gpu_lora_count"] == 4
    async with aiohttp.ClientSession() as session:
        body = {"token_ids": list(range(40))}
        async with session.post(http_url(runtime, "/v1/generate"), json=body) as response:
            assert response.status == 400
    runtime._on_signal(signal.SIGTERM)
    assert await asyncio.wait_for(task, 30) == 0


class TextEngine(RawEngine):
    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[TextEngine, WorkerConfig]:
        return cls(), WorkerConfig(namespace="t")

    async def start(self, worker_id: int) -> EngineConfig:
        return EngineConfig(model="m")

    async def cleanup(self) -> None:
        return None

    async def generate(self, request: dict[str, Any], context: Any) -> AsyncGenerator[Any, None]:
        yield {"done": True}


class TaintEngine(SampleEngine):
    def supported_updates(self) -> set[str]:
        return {"model_taints"}


def test_config_validation() -> None:
    sample = SampleEngine(SampleEngineArgs())
    with pytest.raises(ValueError, match=r"ModelInput\.Tokens"):
        validate_config(sample, WorkerConfig(namespace="t", model_input=ModelInput.Text))
    with pytest.raises(ValueError, match="RawEngine"):
        validate_config(TextEngine(), WorkerConfig(namespace="t"))
    validate_config(TextEngine(), WorkerConfig(namespace="t", model_input=ModelInput.Text))
    with pytest.raises(ValueError, match="route_to_encoder"):
        validate_config(
            sample,
            WorkerConfig(
                namespace="t",
                route_to_encoder=True,
                disaggregation_mode=DisaggregationMode.DECODE,
            ),
        )
    with pytest.raises(ValueError, match="unknown type"):
        validate_config(sample, WorkerConfig(namespace="t", endpoint_types="chat,sql"))
    with pytest.raises(ValueError, match="'model_taints'"):
        validate_config(TaintEngine(SampleEngineArgs()), WorkerConfig(namespace="t"))
    with pytest.raises(ValueError, match="DYN_DISCOVERY_BACKEND='etcd'"):
        WorkerRuntime(sample, WorkerConfig(namespace="t"), SETTINGS)


def test_watchdog_fires_or_not() -> None:
    fired = threading.Event()
    quick = DeadlineWatchdog(0.01, on_expiry=fired.set)
    quick.arm()
    assert fired.wait(5)
    calm = threading.Event()
    disarmed = DeadlineWatchdog(5, on_expiry=calm.set)
    disarmed.arm()
    disarmed.disarm()
    disarmed._thread.join(5)
    assert not calm.is_set()


class PlainEngine(LLMEngine):
    """An engine with no tokenizer, no LoRA, no metrics: the defaults everywhere."""

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[PlainEngine, WorkerConfig]:
        return cls(), WorkerConfig(namespace="t")

    async def start(self, worker_id: int) -> EngineConfig:
        return EngineConfig(model="plain")

    async def cleanup(self) -> None:
        return None

    async def generate(self, request: GenerateRequest, context: Any) -> AsyncGenerator[Any, None]:
        yield {"token_ids": [7], "index": 0, "finish_reason": "stop"}


async def test_plain_engine_without_lora_routes() -> None:
    runtime = WorkerRuntime(
        PlainEngine(),
        WorkerConfig(namespace="t", discovery_backend="mem"),
        SETTINGS,
        discovery=MemBackend(),
        instance_id=5,
    )
    task = await serving(runtime)
    async with aiohttp.ClientSession() as session:
        async with session.get(system_url(runtime, "/v1/loras")) as response:
            assert response.status == 500
            assert "LoRA management not available" in (await response.json())["message"]
        async with session.post(http_url(runtime, "/v1/generate"), json={"token_ids": [1]}) as r:
            assert b'"finish_reason":"stop"' in await r.read()
    runtime._on_signal(signal.SIGTERM)
    assert await asyncio.wait_for(task, 30) == 0


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_worker_facade_runs_until_sigterm(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from dynamo.common.backend import Worker

    port = free_port()
    for name, value in {
        "DYN_SYSTEM_HOST": "127.0.0.1",
        "DYN_SYSTEM_PORT": str(port),
        "DYN_HTTP_HOST": "127.0.0.1",
        "DYN_HTTP_PORT": "0",
        "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0",
    }.items():
        monkeypatch.setenv(name, value)
    engine = RecordingEngine(SampleEngineArgs())
    worker = Worker(engine, WorkerConfig(namespace="t", discovery_backend="mem"))
    task = asyncio.create_task(worker.run())
    async with aiohttp.ClientSession() as session:
        for _ in range(2000):
            try:
                async with session.get(f"http://127.0.0.1:{port}/health") as response:
                    if response.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            assert not task.done(), task
            await asyncio.sleep(0.005)
    # A real SIGTERM: the runtime's handler on the event loop receives it.
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(task, 30)
    assert engine.calls.count("cleanup") == 1
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


async def test_signal_during_startup_never_registers() -> None:
    engine = RecordingEngine(SampleEngineArgs())
    runtime, discovery = make_runtime(engine)

    async def signal_now(endpoint: Any) -> None:
        runtime._on_signal(signal.SIGTERM)

    engine.on_endpoint_ready = signal_now  # type: ignore[method-assign]
    assert await asyncio.wait_for(runtime.run(), 30) == 0
    assert [what for what, _ in discovery.history] == ["close"]
    assert runtime.lifecycle.phase == "shutting down"
    assert engine.calls == ["start", "cleanup"]
