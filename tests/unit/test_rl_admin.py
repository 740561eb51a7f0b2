"""RL admin helpers: env parsing, request validation messages, the route registry."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from dynamo.common.rl import (
    RLAdminValidationError,
    RLRouteRegistry,
    env_bool,
    first_endpoint_response,
    register_rl_routes,
    require_lora_load_request,
    require_lora_unload_request,
)

pytestmark = pytest.mark.unit


class Runtime:
    """Records engine routes; optionally reports a system server URL."""

    def __init__(self, system_url: str | None = None) -> None:
        self.routes: dict[str, Any] = {}
        self._system_url = system_url

    def register_engine_route(self, name: str, handler: Any) -> None:
        self.routes[name] = handler

    def system_status_server_url(self) -> str | None:
        return self._system_url


class BareRuntime:
    """A runtime without a system status server."""

    def register_engine_route(self, name: str, handler: Any) -> None:
        raise AssertionError("not used")


async def ok_handler(body: dict[str, Any]) -> dict[str, Any]:
    return {"status": "ok", "echo": body}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", True),
        ("true", True),
        (" Yes ", True),
        ("ON", True),
        ("", False),
        ("0", False),
        ("no", False),
    ],
)
def test_env_bool(monkeypatch: pytest.MonkeyPatch, raw: str, expected: bool) -> None:
    monkeypatch.setenv("DYN_RL_FLAG", raw)
    assert env_bool("DYN_RL_FLAG", default=not expected) is expected


def test_env_bool_unset_gives_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_RL_FLAG", raising=False)
    assert env_bool("DYN_RL_FLAG") is False
    assert env_bool("DYN_RL_FLAG", True) is True


def test_validation_error_is_a_value_error() -> None:
    assert issubclass(RLAdminValidationError, ValueError)


@pytest.mark.parametrize(
    ("request_body", "message"),
    [
        (None, "Request is required with 'lora_name' and 'source.uri'"),
        ("x", "Request is required with 'lora_name' and 'source.uri'"),
        ({}, "'lora_name' is required and must be a string"),
        ({"lora_name": 5}, "'lora_name' is required and must be a string"),
        ({"lora_name": ""}, "'lora_name' is required and must be a string"),
        ({"lora_name": "a"}, "'source' object is required in request"),
        ({"lora_name": "a", "source": "s3://x"}, "'source' object is required in request"),
        ({"lora_name": "a", "source": {}}, "'source.uri' is required and must be a string"),
        ({"lora_name": "a", "source": {"uri": 1}}, "'source.uri' is required and must be a string"),
    ],
)
def test_lora_load_request_messages(request_body: Any, message: str) -> None:
    with pytest.raises(RLAdminValidationError) as info:
        require_lora_load_request(request_body)
    assert str(info.value) == message


def test_lora_load_request_ok() -> None:
    body = {"lora_name": "math", "source": {"uri": "s3://bucket/math"}, "extra": 1}
    assert require_lora_load_request(body) == ("math", "s3://bucket/math")


@pytest.mark.parametrize(
    ("request_body", "message"),
    [
        (None, "Request is required with 'lora_name' field"),
        ([], "Request is required with 'lora_name' field"),
        ({}, "'lora_name' is required and must be a string"),
        ({"lora_name": None}, "'lora_name' is required and must be a string"),
    ],
)
def test_lora_unload_request_messages(request_body: Any, message: str) -> None:
    with pytest.raises(RLAdminValidationError) as info:
        require_lora_unload_request(request_body)
    assert str(info.value) == message


def test_lora_unload_request_ok() -> None:
    assert require_lora_unload_request({"lora_name": "org/adapter"}) == "org/adapter"


class Tracked:
    """An async-generator handler that records whether it was closed."""

    def __init__(self, items: list[dict[str, Any] | None]) -> None:
        self.items = items
        self.closed = False
        self.produced = 0

    async def __call__(self, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any] | None, None]:
        try:
            for item in self.items:
                self.produced += 1
                yield item
        finally:
            self.closed = True


async def test_first_endpoint_response_returns_first_and_closes() -> None:
    handler = Tracked([{"status": "success", "n": 1}, {"status": "success", "n": 2}])
    assert await first_endpoint_response(handler, {}) == {"status": "success", "n": 1}
    assert handler.closed
    assert handler.produced == 1


@pytest.mark.parametrize("items", [[], [None]])
async def test_first_endpoint_response_defaults_to_ok(items: list[dict[str, Any] | None]) -> None:
    handler = Tracked(items)
    assert await first_endpoint_response(handler, {}) == {"status": "ok"}
    assert handler.closed


def test_registry_routes_and_describe() -> None:
    registry = RLRouteRegistry(Runtime("http://10.0.0.5:9090"))
    registry.add_route("pause_generation", ok_handler)
    registry.add_routes({"flush_cache": ok_handler, "abort_request": ok_handler})
    assert sorted(registry.routes) == ["abort_request", "flush_cache", "pause_generation"]
    assert registry.describe() == {
        "status": "ok",
        "routes": ["abort_request", "flush_cache", "pause_generation"],
        "system_url": "http://10.0.0.5:9090",
    }


def test_describe_omits_missing_system_url() -> None:
    assert RLRouteRegistry(Runtime(None)).describe() == {"status": "ok", "routes": []}
    assert RLRouteRegistry(BareRuntime()).describe() == {"status": "ok", "routes": []}


class FailingUrlRuntime:
    def system_status_server_url(self) -> str:
        raise RuntimeError("server not started")


def test_describe_survives_a_failing_url_lookup(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("rl-test")
    with caplog.at_level(logging.WARNING, logger="rl-test"):
        assert RLRouteRegistry(FailingUrlRuntime(), logger_=logger).describe() == {
            "status": "ok",
            "routes": [],
        }
    assert "system status server URL" in caplog.text


@pytest.mark.parametrize(
    ("request_body", "expected"),
    [
        (None, {"status": "error", "message": "rl_dispatch: request required"}),
        ("routes", {"status": "error", "message": "rl_dispatch: request required"}),
        ({}, {"status": "error", "message": "rl_dispatch: missing 'method' (str)"}),
        ({"method": ""}, {"status": "error", "message": "rl_dispatch: missing 'method' (str)"}),
        ({"method": 3}, {"status": "error", "message": "rl_dispatch: missing 'method' (str)"}),
        (
            {"method": "flush_cache"},
            {
                "status": "error",
                "method": "flush_cache",
                "message": "rl request-plane endpoint only supports method='routes'",
            },
        ),
        (
            {"method": "routes", "kwargs": [1]},
            {
                "status": "error",
                "method": "routes",
                "message": "rl_dispatch: 'kwargs' must be an object",
            },
        ),
        ({"method": "routes", "kwargs": {}}, {"status": "ok", "routes": ["liveness_probe"]}),
        ({"method": "routes"}, {"status": "ok", "routes": ["liveness_probe"]}),
    ],
)
async def test_dispatch(request_body: Any, expected: dict[str, Any]) -> None:
    registry = RLRouteRegistry(Runtime(None))
    registry.add_route("liveness_probe", ok_handler)
    assert await registry.dispatch(request_body) == expected


async def test_dispatch_stream_yields_once() -> None:
    registry = RLRouteRegistry(Runtime(None))
    responses = [item async for item in registry.dispatch_stream({"method": "routes"})]
    assert responses == [{"status": "ok", "routes": []}]


@pytest.mark.parametrize("enable_dispatch", [True, False])
async def test_register_rl_routes(enable_dispatch: bool) -> None:
    runtime = Runtime(None)
    registry = RLRouteRegistry(runtime)
    routes = {"pause_generation": ok_handler, "update_weights_from_disk": ok_handler}
    register_rl_routes(runtime, registry, routes, enable_dispatch=enable_dispatch)
    # Routes are mounted as /engine/<name>, without a control/ prefix.
    assert runtime.routes == routes
    assert registry.routes == (routes if enable_dispatch else {})
    assert await runtime.routes["pause_generation"]({"a": 1}) == {"status": "ok", "echo": {"a": 1}}
