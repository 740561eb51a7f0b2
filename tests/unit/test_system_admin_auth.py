"""The system server's admin-route check (dynamo.runtime.system.auth) on a real loopback server.

The API server's two answers come from `FakeReviewer` here (the real TokenReview and
LocalSubjectAccessReview are exercised in tests/cluster/test_worker_admin_auth.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from dynamo.runtime.health import HealthState
from dynamo.runtime.metrics import RuntimeMetrics, auto_labels
from dynamo.runtime.system import auth
from dynamo.runtime.system.admin import EngineRoutes
from dynamo.runtime.system.server import SystemServer

pytestmark = pytest.mark.unit

ADMIN, NOBODY = "admin-token", "nobody-token"


class FakeReviewer:
    """Two known tokens: one of an authorized service account, one of an unauthorized one."""

    def __init__(self) -> None:
        self.reviews = 0
        self.asked: list[Mapping[str, str]] = []
        self.down = False

    async def authenticate(self, token: str, audience: str) -> auth.Identity | str:
        self.reviews += 1
        if self.down:
            raise auth.ReviewUnavailable("TokenReview failed: HTTP 503 Service Unavailable")
        assert audience == auth.AUDIENCE
        names = {ADMIN: "system:serviceaccount:ns:operator", NOBODY: "system:serviceaccount:x:y"}
        if token not in names:
            return "token signature invalid"
        return auth.Identity(names[token], "uid", ("system:serviceaccounts",))

    async def authorize(
        self, who: auth.Identity, attributes: Mapping[str, str]
    ) -> tuple[bool, str]:
        self.asked.append(attributes)
        return who.username.endswith(":operator"), ""

    async def close(self) -> None:
        pass


async def started(reviewer: FakeReviewer, clock: list[float]) -> TestClient[Any, Any]:
    routes = EngineRoutes()

    async def taints(body: Any) -> dict[str, Any]:
        return {"status": "ok", "got": body}

    async def listing(body: Any) -> dict[str, Any]:
        return {"loras": {}, "count": 0}

    async def load(body: Any) -> dict[str, Any]:
        return {"status": "success", "lora_name": body["lora_name"], "lora_id": 1}

    routes.register("update/model_taints", taints)
    routes.register("update/list_loras", listing)
    routes.register("update/load_lora", load)
    server = SystemServer(
        health=HealthState(),
        metrics=RuntimeMetrics(auto_labels("ns", "backend", "generate", 1)),
        routes=routes,
        metadata=lambda: {"endpoints": {}},
        lora_enabled=True,
        admin_auth=auth.AdminAuth(reviewer, "ns", "dw", clock=lambda: clock[0]),
    )
    client: TestClient[Any, Any] = TestClient(TestServer(server.app(), host="127.0.0.1"))
    await client.start_server()
    return client


LOAD = {"lora_name": "a", "source": {"uri": "s3://b/a"}}


async def test_mutating_routes_need_an_authorized_token() -> None:
    reviewer, clock = FakeReviewer(), [0.0]
    client = await started(reviewer, clock)
    try:
        for method, path, body in (
            ("POST", "/v1/loras", LOAD),
            ("DELETE", "/v1/loras/a", None),
            ("POST", "/engine/update/model_taints", {"taints": []}),
            ("GET", "/engine/update/model_taints", None),
        ):
            bare = await client.request(method, path, json=body)
            assert bare.status == 401, (method, path)
            assert "missing bearer token" in (await bare.json())["message"]
            assert bare.headers["WWW-Authenticate"].startswith("Bearer")
            wrong = await client.request(
                method, path, json=body, headers={"Authorization": "Bearer forged"}
            )
            assert wrong.status == 401
            assert "token signature invalid" in (await wrong.json())["message"]
            denied = await client.request(
                method, path, json=body, headers={"Authorization": f"Bearer {NOBODY}"}
            )
            assert denied.status == 403
            message = (await denied.json())["message"]
            assert "system:serviceaccount:x:y may not change this worker" in message
            assert "update on dynamoworkers/admin 'dw' (dynamo.dev) in namespace 'ns'" in message
        # Other spellings of the same routes are the same routes.
        for path in ("/v1/%6Coras", "/engine/update/%6Dodel_taints", "/v1/loras/a%2Fb"):
            method = "DELETE" if path.endswith("b") else "POST"
            assert (await client.request(method, path, json=LOAD)).status == 401, path
        ok = await client.post("/v1/loras", json=LOAD, headers={"Authorization": f"Bearer {ADMIN}"})
        assert ok.status == 200
        assert (await ok.json())["lora_id"] == 1
        assert reviewer.asked[-1] == {
            "namespace": "ns",
            "group": "dynamo.dev",
            "resource": "dynamoworkers",
            "subresource": "admin",
            "verb": "update",
            "name": "dw",
        }
    finally:
        await client.close()


async def test_read_only_routes_stay_open() -> None:
    reviewer = FakeReviewer()
    client = await started(reviewer, [0.0])
    try:
        assert (await client.get("/v1/loras")).status == 200
        assert (await client.get("/metadata")).status == 200
        assert (await client.get("/metrics")).status == 200
        assert (await client.get("/live")).status == 503  # not ready, but answered
        assert (await client.get("/v1/metadata/a/b/c/d/e/f")).status == 404
        assert reviewer.reviews == 0
    finally:
        await client.close()


async def test_decisions_are_cached_briefly() -> None:
    reviewer, clock = FakeReviewer(), [0.0]
    client = await started(reviewer, clock)
    headers = {"Authorization": f"Bearer {ADMIN}"}
    try:
        for _ in range(3):
            assert (await client.post("/v1/loras", json=LOAD, headers=headers)).status == 200
        assert reviewer.reviews == 1
        clock[0] += auth.CACHE_SECONDS + 0.1
        assert (await client.post("/v1/loras", json=LOAD, headers=headers)).status == 200
        assert reviewer.reviews == 2
    finally:
        await client.close()


async def test_unreachable_api_server_is_503_and_not_cached() -> None:
    reviewer = FakeReviewer()
    reviewer.down = True
    client = await started(reviewer, [0.0])
    headers = {"Authorization": f"Bearer {ADMIN}"}
    try:
        response = await client.post("/v1/loras", json=LOAD, headers=headers)
        assert response.status == 503
        assert "cannot check the caller" in (await response.json())["message"]
        reviewer.down = False
        assert (await client.post("/v1/loras", json=LOAD, headers=headers)).status == 200
    finally:
        await client.close()


def test_off_unless_asked() -> None:
    assert auth.from_env({}) is None
    assert auth.from_env({"DYN_SYSTEM_ADMIN_AUTH": "off"}) is None
    with pytest.raises(ValueError, match="POD_NAMESPACE"):
        auth.from_env({"DYN_SYSTEM_ADMIN_AUTH": "kubernetes"})
    with pytest.raises(ValueError, match="use one of off, kubernetes"):
        auth.from_env({"DYN_SYSTEM_ADMIN_AUTH": "yes"})
    on = auth.from_env({"DYN_SYSTEM_ADMIN_AUTH": "kubernetes", "POD_NAMESPACE": "ns"})
    assert on is not None
    assert on.permission == "update on dynamoworkers/admin (dynamo.dev) in namespace 'ns'"


@pytest.mark.parametrize(
    ("method", "path", "guarded"),
    [
        ("POST", "/v1/loras", True),
        ("DELETE", "/v1/loras/org/name", True),
        ("GET", "/v1/loras", False),
        ("HEAD", "/v1/loras", False),
        ("GET", "/engine/routes", True),
        ("POST", "/engine/update/weights", True),
        ("GET", "/metrics", False),
        ("GET", "/v1/lorasx", False),
    ],
)
def test_which_routes_are_guarded(method: str, path: str, guarded: bool) -> None:
    assert auth.is_admin_route(method, path) is guarded
