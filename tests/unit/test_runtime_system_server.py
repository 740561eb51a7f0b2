"""The system status server's routes, codes and bodies, on a real loopback server."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from dynamo.runtime.health import HealthState
from dynamo.runtime.metrics import RuntimeMetrics, auto_labels
from dynamo.runtime.system.admin import RUNNING, AdminRoutes, EngineRoutes, Lifecycle
from dynamo.runtime.system.loras import lora_response
from dynamo.runtime.system.server import SystemServer

pytestmark = pytest.mark.unit


class Harness:
    def __init__(self) -> None:
        self.health = HealthState()
        self.metrics = RuntimeMetrics(auto_labels("ns", "backend", "generate", 1))
        self.routes = EngineRoutes()
        self.metadata: dict[str, Any] | None = None


async def client_for(harness: Harness, **kwargs: Any) -> TestClient[Any, Any]:
    server = SystemServer(
        health=harness.health,
        metrics=harness.metrics,
        routes=harness.routes,
        metadata=lambda: harness.metadata,
        **kwargs,
    )
    client: TestClient[Any, Any] = TestClient(TestServer(server.app(), host="127.0.0.1"))
    await client.start_server()
    return client


@pytest.fixture
def harness() -> Harness:
    return Harness()


async def test_health_and_live(harness: Harness) -> None:
    client = await client_for(harness)
    try:
        for path in ("/health", "/live"):
            response = await client.get(path)
            assert response.status == 503
            assert response.content_type == "text/plain"
            body = json.loads(await response.text())
            assert body["status"] == "notready"
        harness.health.set_system_ready(True)
        harness.health.set_endpoint_ready("generate", True)
        response = await client.get("/health")
        assert response.status == 200
        text = await response.text()
        assert '"status":"ready"' in text  # compact, like upstream
        assert json.loads(text)["endpoints"] == {"generate": "ready"}
    finally:
        await client.close()


async def test_custom_health_paths_replace_defaults(harness: Harness) -> None:
    client = await client_for(harness, health_path="/ready", live_path="/alive")
    try:
        assert (await client.get("/ready")).status == 503
        assert (await client.get("/alive")).status == 503
        response = await client.get("/health")
        assert response.status == 404
        assert await response.text() == "Route not found"
    finally:
        await client.close()


async def test_metrics_and_metadata(harness: Harness) -> None:
    client = await client_for(harness)
    try:
        response = await client.get("/metrics")
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        names = {family.name for family in text_string_to_metric_families(await response.text())}
        assert "dynamo_component_requests" in names
        response = await client.get("/metadata")
        assert response.status == 404
        assert await response.text() == "Discovery metadata not available"
        harness.metadata = {"endpoints": {}, "model_cards": {}}
        response = await client.get("/metadata")
        assert response.status == 200
        assert await response.json() == harness.metadata
    finally:
        await client.close()


async def test_broken_metrics_is_500(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> str:
        raise RuntimeError("registry gone")

    monkeypatch.setattr(harness.metrics, "exposition", broken)
    client = await client_for(harness)
    try:
        response = await client.get("/metrics")
        assert response.status == 500
        assert await response.text() == "Failed to get metrics"
    finally:
        await client.close()


async def test_engine_routes(harness: Harness) -> None:
    seen: list[Any] = []

    async def echo(body: Any) -> dict[str, Any]:
        seen.append(body)
        return {"status": "ok", "got": body}

    async def failing(body: Any) -> dict[str, Any]:
        raise ValueError("bad weights")

    harness.routes.register("update/echo", echo)
    harness.routes.register("broken", failing)
    client = await client_for(harness)
    try:
        response = await client.post("/engine/update/echo", data=b"")
        assert response.status == 200
        assert await response.json() == {"status": "ok", "got": {}}
        response = await client.put("/engine/update/echo", json={"a": 1})
        assert await response.json() == {"status": "ok", "got": {"a": 1}}
        response = await client.post("/engine/update/echo", data=b"{nope")
        assert response.status == 400
        assert (await response.json())["error"] == "Invalid JSON"
        response = await client.post("/engine/nothing/here", json={})
        assert response.status == 404
        assert await response.json() == {
            "error": "Route not found",
            "message": "Route /engine/nothing/here not found",
        }
        response = await client.post("/engine/broken", json={})
        assert response.status == 500
        assert await response.json() == {
            "error": "Handler error",
            "message": "Python callback failed: bad weights",
        }
        assert seen == [{}, {"a": 1}]
        response = await client.get("/nowhere")
        assert response.status == 404
        assert await response.text() == "Route not found"
    finally:
        await client.close()


async def test_loras_are_mounted_only_when_enabled(harness: Harness) -> None:
    client = await client_for(harness)
    try:
        assert (await client.get("/v1/loras")).status == 404
    finally:
        await client.close()


async def test_lora_routes_forward_and_map_status(harness: Harness) -> None:
    calls: list[tuple[str, Any]] = []
    answers: dict[str, dict[str, Any]] = {
        "load_lora": {"status": "success", "lora_name": "a/b", "lora_id": 7, "hot_swap": False,
                      "downloaded_bytes": 10},
        "unload_lora": {"status": "error", "message": "LoRA adapter 'x' not found",
                        "reason": "not loaded"},
        "list_loras": {"status": "success", "loras": {"a/b": 7}, "count": 1},
    }  # fmt: skip

    def route(op: str) -> Any:
        async def handle(body: Any) -> dict[str, Any]:
            calls.append((op, body))
            return answers[op]

        return handle

    for op in answers:
        harness.routes.register(f"update/{op}", route(op))
    client = await client_for(harness, lora_enabled=True)
    try:
        body = {"lora_name": "a/b", "source": {"uri": "s3://bucket/a"}}
        response = await client.post("/v1/loras", json=body)
        assert response.status == 200
        assert await response.json() == {
            "status": "success",
            "lora_name": "a/b",
            "lora_id": 7,
            "hot_swap": False,
        }
        response = await client.delete("/v1/loras/org/adapter")
        assert response.status == 500
        assert (await response.json())["reason"] == "not loaded"
        response = await client.get("/v1/loras")
        assert response.status == 200
        assert await response.json() == {"status": "success", "loras": {"a/b": 7}, "count": 1}
        assert calls == [
            ("load_lora", body),
            ("unload_lora", {"lora_name": "org/adapter"}),
            ("list_loras", {}),
        ]
        # Bodies upstream's JSON extractor refuses never reach the engine.
        refused = [
            (b"{", "application/json", 400, "Failed to parse the request body as JSON: "),
            (b"{}", "application/json", 422, "Failed to deserialize the JSON body into "),
            (b'{"lora_name": 3}', "application/json", 422, "Failed to deserialize the JSON "),
            (b'{"lora_name": "a"}', "application/json", 422, "Failed to deserialize the JSON "),
            (b'{"lora_name": "a", "source": {"uri": "u"}}', "text/plain", 415, "Expected "),
        ]
        for data, content_type, status, text in refused:
            headers = {"Content-Type": content_type}
            response = await client.post("/v1/loras", data=data, headers=headers)
            assert (response.status, response.content_type) == (status, "text/plain"), data
            assert (await response.text()).startswith(text), data
        assert len(calls) == 3
        # Upstream also takes the struct as a sequence of its fields.
        response = await client.post("/v1/loras", json=["a/b", {"uri": "s3://bucket/a"}])
        assert response.status == 200
        assert calls[-1] == ("load_lora", body)
    finally:
        await client.close()


async def test_lora_routes_without_handlers(harness: Harness) -> None:
    client = await client_for(harness, lora_enabled=True)
    try:
        response = await client.post("/v1/loras", json={"lora_name": "a", "source": {"uri": "x"}})
        assert response.status == 500
        message = (await response.json())["message"]
        assert "lora management not available" in message.lower()
        assert "'load_lora'" in message
    finally:
        await client.close()


def test_lora_response_projection() -> None:
    assert lora_response(None) == {"status": "success"}
    assert lora_response({"lora_name": "a", "extra": 1}) == {"status": "success", "lora_name": "a"}


class RecordingDiscovery:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail: set[str] = set()

    async def register(self) -> None:
        self.calls.append("register")
        if "register" in self.fail:
            raise RuntimeError("api server down")

    async def unregister(self) -> None:
        self.calls.append("unregister")
        if "unregister" in self.fail:
            raise RuntimeError("api server down")


async def test_admin_gate_and_control_discovery_policy() -> None:
    lifecycle = Lifecycle()
    discovery = RecordingDiscovery()
    engine_calls: list[tuple[str, dict[str, Any]]] = []
    replies: dict[str, dict[str, Any]] = {}

    async def control(name: str, body: dict[str, Any]) -> dict[str, Any]:
        engine_calls.append((name, body))
        discovery.calls.append(f"engine:{name}")
        return replies.get(name, {"status": "ok"})

    admin = AdminRoutes(
        lifecycle,
        control=control,
        update=control,
        unregister=discovery.unregister,
        register=discovery.register,
    )
    pause = admin.control_route("pause_generation")
    resume = admin.control_route("resume_generation")
    flush = admin.control_route("flush_cache")
    update = admin.update_route("load_lora")
    assert await pause({}) == {
        "status": "error",
        "message": "engine administrative routes are unavailable while the worker is starting",
    }
    assert await update([1]) == {
        "status": "error",
        "message": "engine update request body must be a JSON object",
    }
    assert await flush("x") == {
        "status": "error",
        "message": "engine control request body must be a JSON object",
    }
    lifecycle.phase = RUNNING
    assert await pause({"mode": "abort"}) == {"status": "ok"}
    assert discovery.calls == ["unregister", "engine:pause_generation"]
    assert await resume({}) == {"status": "ok"}
    assert discovery.calls[-2:] == ["engine:resume_generation", "register"]
    discovery.calls.clear()
    replies["wake_up"] = {"status": "ok", "is_sleeping": True}
    await admin.control_route("wake_up")({})
    replies["resume_memory_occupation"] = {"success": False}
    await admin.control_route("resume_memory_occupation")({})
    await flush({})
    assert "register" not in discovery.calls
    discovery.fail = {"unregister"}
    answer = await admin.control_route("sleep")({})
    assert answer["message"].startswith(
        "failed to unregister endpoint before /engine/control/sleep"
    )
    discovery.fail = {"register"}
    answer = await resume({})
    assert answer["message"].startswith("engine resumed but re-registration failed")
    assert "retry /engine/control/resume_generation" in answer["message"]
    lifecycle.phase = "shutting down"
    assert (await update({}))["message"].endswith("while the worker is shutting down")
