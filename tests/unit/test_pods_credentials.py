"""The operator's token for worker pods (pods.credentials): sent on every request, read again
each time (the kubelet rotates it), absent without harm; a refusal becomes a reason."""

from __future__ import annotations

import logging
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dynamo_operator.pods.adapters import OPERATOR_NOT_ADMITTED, LoraClient
from dynamo_operator.pods.credentials import BearerToken

pytestmark = pytest.mark.unit


async def test_each_request_carries_the_current_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[str | None] = []

    async def record(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != "Bearer second":
            return web.json_response({"error": "Forbidden", "message": "needs update"}, status=403)
        return web.json_response({"status": "success", "lora_id": 7})

    app = web.Application()
    app.router.add_post("/v1/loras", record)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    token = tmp_path / "token"
    async with aiohttp.ClientSession(middlewares=(BearerToken(token),)) as session:
        lora = LoraClient(session, url_for=lambda ip, path: str(server.make_url(path)))
        with caplog.at_level(logging.WARNING):
            missing = await lora.load("127.0.0.1", "a", "s3://b/a", None)
            await lora.load("127.0.0.1", "a", "s3://b/a", None)
        assert [r.message.count("no worker-admin token") for r in caplog.records] == [1]
        token.write_text("first\n")
        refused = await lora.load("127.0.0.1", "a", "s3://b/a", None)
        token.write_text("second")  # rotated
        loaded = await lora.load("127.0.0.1", "a", "s3://b/a", None)
    await server.close()
    assert seen == [None, None, "Bearer first", "Bearer second"]
    assert (missing.ok, missing.reason) == (False, OPERATOR_NOT_ADMITTED)
    assert (refused.reason, refused.message) == (OPERATOR_NOT_ADMITTED, "needs update")
    assert loaded.ok
    assert loaded.lora_id == 7
