"""The model-taint admin route: body validation, messages, and the success body."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from dynamo.common import model_taints
from dynamo.common.model_taints import (
    MODEL_TAINT_ROUTE,
    TOPOLOGY_TAINT_PREFIX,
    make_model_taint_handler,
    register_model_taint_route,
    validate_model_taints,
)

pytestmark = pytest.mark.unit


class RouteRecorder:
    """A runtime exposing only `register_engine_route`, recording what was registered."""

    def __init__(self) -> None:
        self.routes: dict[str, Any] = {}

    def register_engine_route(self, name: str, handler: Any) -> None:
        self.routes[name] = handler


class TaintStore:
    """Stands in for the discovery update: remembers each (endpoint, taints) call."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, set[str]]] = []

    async def update(self, endpoint: Any, taints: set[str]) -> None:
        self.calls.append((endpoint, taints))


def test_constants() -> None:
    assert MODEL_TAINT_ROUTE == "update/model_taints"
    assert TOPOLOGY_TAINT_PREFIX == "dynamo.topology/"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (None, "request body must be a JSON object"),
        (["a"], "request body must be a JSON object"),
        ({}, "'taints' must be a JSON array of strings"),
        ({"taints": "gpu=a100"}, "'taints' must be a JSON array of strings"),
        ({"taints": ["ok", 3]}, "'taints' must be a JSON array of strings"),
        ({"taints": None}, "'taints' must be a JSON array of strings"),
        (
            {"taints": ["ok", "dynamo.topology/zone=a"]},
            "taint 'dynamo.topology/zone=a' uses reserved prefix 'dynamo.topology/'",
        ),
    ],
)
def test_invalid_bodies(body: object, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        validate_model_taints(body)


def test_valid_body_is_sorted_and_deduplicated() -> None:
    assert validate_model_taints({"taints": ["b", "a", "b"]}) == ["a", "b"]
    assert validate_model_taints({"taints": []}) == []


async def test_handler_publishes_and_answers_with_sorted_taints() -> None:
    store = TaintStore()
    endpoint = object()
    handler = make_model_taint_handler(endpoint, store.update)
    assert await handler({"taints": ["zone-b", "gpu", "zone-b"]}) == {
        "status": "ok",
        "taints": ["gpu", "zone-b"],
    }
    assert store.calls == [(endpoint, {"gpu", "zone-b"})]
    # An empty list clears the caller-managed taints.
    assert await handler({"taints": []}) == {"status": "ok", "taints": []}
    assert store.calls[-1] == (endpoint, set())


async def test_handler_rejects_before_publishing() -> None:
    store = TaintStore()
    handler = make_model_taint_handler(object(), store.update)
    with pytest.raises(ValueError, match="reserved prefix"):
        await handler({"taints": ["dynamo.topology/rack=1"]})
    assert store.calls == []


async def test_register_uses_the_update_route_and_needs_the_runtime() -> None:
    runtime = RouteRecorder()
    register_model_taint_route(runtime, endpoint=object())
    assert list(runtime.routes) == ["update/model_taints"]
    handler = runtime.routes["update/model_taints"]
    # Validation works without the runtime's discovery layer...
    with pytest.raises(ValueError, match="request body must be a JSON object"):
        await handler("not a dict")
    # ...publishing needs `dynamo.llm`, which this process does not have.
    with pytest.raises(RuntimeError, match=r"dynamo\.llm\.update_model_taints"):
        await handler({"taints": ["gpu"]})


async def test_the_route_calls_update_model_taints_through_the_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Upstream's seam: replacing or wrapping the module's coroutine function changes what
    # the registered route does, also after registration.
    runtime = RouteRecorder()
    endpoint = object()
    register_model_taint_route(runtime, endpoint=endpoint)
    store = TaintStore()
    monkeypatch.setattr(model_taints, "update_model_taints", store.update)
    handler = runtime.routes[MODEL_TAINT_ROUTE]
    assert await handler({"taints": ["gpu=h100", "zone=a"]}) == {
        "status": "ok",
        "taints": ["gpu=h100", "zone=a"],
    }
    assert store.calls == [(endpoint, {"gpu=h100", "zone=a"})]

    wrapped: list[set[str]] = []

    async def wrapper(endpoint: Any, taints: set[str]) -> None:
        wrapped.append(taints)
        await store.update(endpoint, taints)

    monkeypatch.setattr(model_taints, "update_model_taints", wrapper)
    await handler({"taints": []})
    assert wrapped == [set()]
    assert store.calls[-1] == (endpoint, set())


async def test_update_model_taints_is_a_coroutine_publishing_through_the_endpoint() -> None:
    assert inspect.iscoroutinefunction(model_taints.update_model_taints)
    assert list(inspect.signature(model_taints.update_model_taints).parameters) == [
        "endpoint",
        "taints",
    ]

    class WorkerEndpoint:
        """This worker runtime's endpoints publish through their own discovery record."""

        def __init__(self) -> None:
            self.published: list[set[str]] = []

        async def publish_model_taints(self, taints: set[str]) -> None:
            self.published.append(taints)

    endpoint = WorkerEndpoint()
    await model_taints.update_model_taints(endpoint, {"a"})
    assert endpoint.published == [{"a"}]
    # Another endpoint needs the runtime's `dynamo.llm`, which this process does not have.
    with pytest.raises(RuntimeError, match=r"dynamo\.llm\.update_model_taints"):
        await model_taints.update_model_taints(object(), {"a"})
