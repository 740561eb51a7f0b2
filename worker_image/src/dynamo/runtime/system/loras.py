"""`/v1/loras` on the system server: LoRA management forwarded to the engine's updates.

* `POST /v1/loras` `{"lora_name": str, "source": {"uri": str[, "sha256": str]}}` -> `load_lora`
  (a body upstream's `Json` extractor refuses gets its 415, 400 or 422 first: `json_body`)
* `DELETE /v1/loras/{name}` (the name may contain `/`) -> `unload_lora`
* `GET /v1/loras` -> `list_loras`

Each goes to the route registered as `<op>` (legacy workers), else `update/<op>` (the engine
update, gated by the lifecycle). Answers follow upstream's `LoraResponse`: POST and DELETE
are 500 when the engine answered `"status": "error"` or forwarding failed, else 200; GET is
200 whenever forwarding worked. Only the upstream fields (plus `reason` and `hot_swap`,
which say why a load failed and whether it replaced a version, and the list's `sources`,
which says where each adapter came from) are passed on.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web

from dynamo.runtime.system import json_body
from dynamo.runtime.system.admin import EngineRoutes

logger = logging.getLogger(__name__)

# Upstream's `LoadLoraRequest { lora_name: String, source: LoraSource { uri: String } }`.
LOAD_LORA_REQUEST = json_body.Struct(
    "LoadLoraRequest",
    (("lora_name", None), ("source", json_body.Struct("LoraSource", (("uri", None),)))),
)

_RESPONSE_FIELDS = ("status", "message", "lora_name", "lora_id", "loras", "count")
_EXTRA_FIELDS = ("reason", "hot_swap", "sources")


def lora_response(result: Any) -> dict[str, Any]:
    """Project an engine answer onto upstream's `LoraResponse` (`status` defaults to
    "success"; absent fields are omitted)."""
    if not isinstance(result, dict):
        return {"status": "success"}
    body = {key: result[key] for key in (*_RESPONSE_FIELDS, *_EXTRA_FIELDS) if key in result}
    body.setdefault("status", "success")
    return body


class LoraRoutes:
    """The three `/v1/loras` handlers over an `EngineRoutes` registry."""

    def __init__(self, routes: EngineRoutes) -> None:
        self._routes = routes

    def add_to(self, app: web.Application) -> None:
        """Mount the routes on `app`."""
        app.router.add_get("/v1/loras", self.list_loras)
        app.router.add_post("/v1/loras", self.load_lora)
        app.router.add_delete("/v1/loras/{lora_name:.+}", self.unload_lora)

    async def load_lora(self, request: web.Request) -> web.Response:
        """POST /v1/loras; a body upstream's JSON extractor refuses is answered as it does
        (415, 400 or 422, plain text) before any engine is asked."""
        raw = await request.read()
        try:
            body = json_body.extract(request.headers.get("Content-Type"), raw, LOAD_LORA_REQUEST)
        except json_body.Rejection as exc:
            return web.Response(text=exc.text, status=exc.status)
        return await self._forward("load_lora", body, errors_are_500=True)

    async def unload_lora(self, request: web.Request) -> web.Response:
        """DELETE /v1/loras/{lora_name}."""
        name = request.match_info["lora_name"]
        return await self._forward("unload_lora", {"lora_name": name}, errors_are_500=True)

    async def list_loras(self, request: web.Request) -> web.Response:
        """GET /v1/loras."""
        del request
        return await self._forward("list_loras", {}, errors_are_500=False)

    async def _forward(self, op: str, body: Any, *, errors_are_500: bool) -> web.Response:
        callback = self._routes.get(op) or self._routes.get(f"update/{op}")
        if callback is None:
            message = (
                f"LoRA management not available: no '{op}' handler is registered (the engine "
                f"does not advertise the '{op}' update)"
            )
            return _response({"status": "error", "message": message}, 500)
        try:
            result = await callback(body)
        except Exception as exc:
            logger.exception("/v1/loras %s failed", op)
            return _response({"status": "error", "message": f"{op} failed: {exc}"}, 500)
        answer = lora_response(result)
        failed = answer["status"] == "error"
        if failed:
            # The same text the caller gets (it names no credential), so that the pod's log
            # says why, as the operator's fix texts tell users to read it.
            name = body.get("lora_name") if isinstance(body, dict) else None
            logger.warning("/v1/loras %s %s failed: %s", op, name or "", answer.get("message"))
        return _response(answer, 500 if failed and errors_are_500 else 200)


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _response(body: dict[str, Any], status: int) -> web.Response:
    return web.json_response(body, status=status, dumps=_compact)
