"""The `/engine/update/model_taints` admin route: replace this worker's model taints.

A taint is a string label on the worker's base model card; requests can require or prefer
taints when routing. Taints under `dynamo.topology/` are generated from the worker's
topology and may not be set by callers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

MODEL_TAINT_ROUTE = "update/model_taints"
TOPOLOGY_TAINT_PREFIX = "dynamo.topology/"

# `(endpoint, taints) -> None`: publishes the new caller-managed taint set for the endpoint.
TaintUpdater = Callable[[Any, set[str]], Awaitable[None]]
TaintRouteHandler = Callable[[Any], Awaitable[dict[str, Any]]]


def validate_model_taints(body: object) -> list[str]:
    """Check a route body `{"taints": [str, ...]}`; return the unique taints, sorted.

    Raises ValueError with the message the route reports for each kind of bad body.
    """
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    taints = body.get("taints")
    if not isinstance(taints, list) or not all(isinstance(taint, str) for taint in taints):
        raise ValueError("'taints' must be a JSON array of strings")
    for taint in taints:
        if taint.startswith(TOPOLOGY_TAINT_PREFIX):
            raise ValueError(f"taint '{taint}' uses reserved prefix '{TOPOLOGY_TAINT_PREFIX}'")
    return sorted(set(taints))


async def update_model_taints(endpoint: Any, taints: set[str]) -> None:
    """Publish `taints` as the endpoint's caller-managed model taints.

    Upstream's seam: the route calls this function through the module, so code may replace
    or wrap it. An endpoint of this worker runtime publishes through its own discovery
    (`publish_model_taints`); any other needs the runtime's `dynamo.llm.update_model_taints`.
    """
    publish = getattr(endpoint, "publish_model_taints", None)
    if publish is not None:
        await publish(taints)
        return
    # Resolved per call: this module must stay importable (and its route registrable)
    # where no worker runtime is loaded.
    try:
        from dynamo.llm import update_model_taints as runtime_update_model_taints
    except ImportError as exc:
        raise RuntimeError(
            "model taint updates need the Dynamo worker runtime (dynamo.llm.update_model_taints),"
            " which is not available in this process"
        ) from exc
    await runtime_update_model_taints(endpoint, taints)


def make_model_taint_handler(
    endpoint: Any, update_taints: TaintUpdater | None = None
) -> TaintRouteHandler:
    """Build the route callback: validate the body, publish the taints, answer with them.

    An empty list clears the caller-managed taints. `update_taints` defaults to this
    module's `update_model_taints`, looked up at each call.
    """

    async def handle(body: Any) -> dict[str, Any]:
        taints = validate_model_taints(body)
        await (update_taints or update_model_taints)(endpoint, set(taints))
        return {"status": "ok", "taints": taints}

    return handle


def register_model_taint_route(runtime: Any, endpoint: Any) -> None:
    """Register POST /engine/update/model_taints on the system status server."""
    runtime.register_engine_route(MODEL_TAINT_ROUTE, make_model_taint_handler(endpoint))
