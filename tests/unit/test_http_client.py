"""Both HTTP backends against real aiohttp servers on loopback.

Loopback is refused by the default policy, so fetches that must succeed use a policy that
exempts exactly 127.0.0.1/32; a second server on 127.0.0.2 plays an internal service and
records its requests, which proves that a refused redirect hop is never contacted.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from dynamo.common.http import (
    AiohttpClient,
    HttpClient,
    HttpConfigBase,
    HttpConnectionError,
    HttpError,
    HttpStatusError,
    HttpTimeoutError,
    HttpxClient,
    UrlValidationError,
    UrlValidationPolicy,
    close_http_client,
    fetch_bytes,
    get_default_client,
)
from support.loopback_http import LoopbackHttpServer, loopback_policy, serve

pytestmark = pytest.mark.unit

PAYLOAD = bytes(range(256)) * 64


def build_app(release: asyncio.Event) -> web.Application:
    async def payload(request: web.Request) -> web.Response:
        return web.Response(body=PAYLOAD)

    async def status(request: web.Request) -> web.Response:
        code = int(request.match_info["code"])
        return web.Response(status=code, text=f"status {code}")

    async def slow(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="late")

    async def chain(request: web.Request) -> web.Response:
        remaining = int(request.match_info["n"])
        target = "/payload" if remaining == 0 else f"/chain/{remaining - 1}"
        raise web.HTTPFound(target)

    async def to(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(request.query["url"])

    async def relative(request: web.Request) -> web.Response:
        return web.Response(status=301, headers={"Location": "payload"})

    async def no_location(request: web.Request) -> web.Response:
        return web.Response(status=302, text="no location here")

    async def drop(request: web.Request) -> web.Response:
        assert request.transport is not None
        request.transport.abort()
        return web.Response(text="never sent")

    app = web.Application()
    app.router.add_get("/payload", payload)
    app.router.add_get("/status/{code}", status)
    app.router.add_get("/slow", slow)
    app.router.add_get("/chain/{n}", chain)
    app.router.add_get("/to", to)
    app.router.add_get("/dir/relative", relative)
    app.router.add_get("/dir/payload", payload)
    app.router.add_get("/no-location", no_location)
    app.router.add_get("/drop", drop)
    return app


@pytest.fixture(scope="module")
async def servers() -> AsyncIterator[tuple[LoopbackHttpServer, LoopbackHttpServer]]:
    release = asyncio.Event()
    async with (
        serve(build_app(release), "127.0.0.1") as public,
        serve(build_app(release), "127.0.0.2") as internal,
    ):
        yield public, internal
        release.set()


@pytest.fixture
def server(
    servers: tuple[LoopbackHttpServer, LoopbackHttpServer],
) -> LoopbackHttpServer:
    servers[0].requests.clear()
    servers[1].requests.clear()
    return servers[0]


@pytest.fixture
def internal(servers: tuple[LoopbackHttpServer, LoopbackHttpServer]) -> LoopbackHttpServer:
    return servers[1]


@pytest.fixture(params=["aiohttp", "httpx"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[HttpClient]:
    cls = AiohttpClient if request.param == "aiohttp" else HttpxClient
    instance = cls(HttpConfigBase())
    yield instance
    await instance.close()


# --- plain fetches and error mapping ----------------------------------------------------


@pytest.mark.parametrize("policy", [None, loopback_policy()], ids=["native", "policy"])
async def test_fetch_returns_the_body(
    client: HttpClient, server: LoopbackHttpServer, policy: UrlValidationPolicy | None
) -> None:
    assert await client.fetch_bytes(server.url("payload"), 5.0, policy=policy) == PAYLOAD


@pytest.mark.parametrize("code", [404, 415, 500, 503])
@pytest.mark.parametrize("policy", [None, loopback_policy()], ids=["native", "policy"])
async def test_status_errors_keep_the_status(
    client: HttpClient, server: LoopbackHttpServer, code: int, policy: UrlValidationPolicy | None
) -> None:
    url = server.url(f"status/{code}")
    with pytest.raises(HttpStatusError) as caught:
        await client.fetch_bytes(url, 5.0, policy=policy)
    assert caught.value.status == code
    assert caught.value.url == url
    assert str(caught.value).startswith(f"HTTP {code} for {url}: ")
    assert isinstance(caught.value, HttpError)


@pytest.mark.parametrize("policy", [None, loopback_policy()], ids=["native", "policy"])
async def test_timeouts_map_to_http_timeout_error(
    client: HttpClient, server: LoopbackHttpServer, policy: UrlValidationPolicy | None
) -> None:
    with pytest.raises(HttpTimeoutError, match="Timeout loading"):
        await client.fetch_bytes(server.url("slow"), 0.3, policy=policy)


async def test_per_call_timeout_override_replaces_the_callers_timeout(
    server: LoopbackHttpServer,
) -> None:
    for cls in (AiohttpClient, HttpxClient):
        instance = cls(HttpConfigBase(per_call_timeout_override=0.3))
        try:
            with pytest.raises(HttpTimeoutError):
                # 60 s asked for; the override cuts it to 0.3 s.
                await asyncio.wait_for(instance.fetch_bytes(server.url("slow"), 60.0), 20)
        finally:
            await instance.close()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("policy", [None, loopback_policy()], ids=["native", "policy"])
async def test_refused_connections_map_to_http_connection_error(
    client: HttpClient, policy: UrlValidationPolicy | None
) -> None:
    url = f"http://127.0.0.1:{closed_port()}/x"
    with pytest.raises(HttpConnectionError, match="Connection error loading"):
        await client.fetch_bytes(url, 5.0, policy=policy)


@pytest.mark.parametrize("policy", [None, loopback_policy()], ids=["native", "policy"])
async def test_dropped_connections_map_to_http_connection_error(
    client: HttpClient, server: LoopbackHttpServer, policy: UrlValidationPolicy | None
) -> None:
    with pytest.raises(HttpConnectionError):
        await client.fetch_bytes(server.url("drop"), 5.0, policy=policy)


# --- redirects ----------------------------------------------------------------------------


async def test_native_mode_follows_redirects(
    client: HttpClient, server: LoopbackHttpServer
) -> None:
    assert await client.fetch_bytes(server.url("chain/5"), 5.0) == PAYLOAD


async def test_policy_mode_follows_up_to_three_redirects(
    client: HttpClient, server: LoopbackHttpServer
) -> None:
    policy = loopback_policy()
    # chain/2 -> chain/1 -> chain/0 -> payload: three redirects.
    assert await client.fetch_bytes(server.url("chain/2"), 5.0, policy=policy) == PAYLOAD
    assert server.requests == ["/chain/2", "/chain/1", "/chain/0", "/payload"]


async def test_policy_mode_refuses_a_fourth_redirect(
    client: HttpClient, server: LoopbackHttpServer
) -> None:
    with pytest.raises(UrlValidationError, match=r"Too many redirects \(max=3\); chain=\[") as e:
        await client.fetch_bytes(server.url("chain/3"), 5.0, policy=loopback_policy())
    assert server.url("chain/3") in str(e.value)
    # The fourth redirect (to /payload) is refused without being followed.
    assert server.requests == ["/chain/3", "/chain/2", "/chain/1", "/chain/0"]


async def test_policy_mode_resolves_relative_locations(
    client: HttpClient, server: LoopbackHttpServer
) -> None:
    body = await client.fetch_bytes(server.url("dir/relative"), 5.0, policy=loopback_policy())
    assert body == PAYLOAD
    assert server.requests == ["/dir/relative", "/dir/payload"]


async def test_policy_mode_returns_the_body_of_a_redirect_without_location(
    client: HttpClient, server: LoopbackHttpServer
) -> None:
    body = await client.fetch_bytes(server.url("no-location"), 5.0, policy=loopback_policy())
    assert body == b"no location here"


REDIRECT_TARGETS = [
    ("http://169.254.169.254/latest/meta-data/iam/", "blocked range"),
    ("http://10.0.0.7/admin", "blocked range"),
    ("http://192.168.1.1/", "blocked range"),
    ("http://[::1]/", "blocked range"),
    ("http://167772167/", "blocked range"),  # decimal 10.0.0.7
    ("http://localhost/", "is blocked"),
    ("http://metadata.google.internal/computeMetadata/v1/", "is blocked"),
    ("http://intranet.example.com/", "resolves to blocked IP '10.20.30.40'"),
    ("file:///etc/passwd", "scheme 'file' not allowed"),
]


@pytest.mark.parametrize(("target", "reason"), REDIRECT_TARGETS)
async def test_redirects_to_internal_targets_are_refused(
    client: HttpClient, server: LoopbackHttpServer, target: str, reason: str
) -> None:
    policy = loopback_policy(**{"intranet.example.com": ["10.20.30.40"]})
    with pytest.raises(UrlValidationError, match=reason.replace("(", r"\(")):
        await client.fetch_bytes(server.url("to") + f"?url={target}", 5.0, policy=policy)


async def test_refused_redirect_hop_is_never_contacted(
    client: HttpClient, server: LoopbackHttpServer, internal: LoopbackHttpServer
) -> None:
    secret = internal.url("payload")
    policy = loopback_policy()
    with pytest.raises(UrlValidationError, match=r"IP literal '127\.0\.0\.2' is in a blocked"):
        await client.fetch_bytes(server.url("to") + f"?url={secret}", 5.0, policy=policy)
    assert internal.requests == []
    # Without a policy the same redirect is followed: that is what the policy prevents.
    assert await client.fetch_bytes(server.url("to") + f"?url={secret}", 5.0) == PAYLOAD
    assert internal.requests == ["/payload"]


async def test_default_policy_refuses_loopback_before_connecting(
    client: HttpClient, server: LoopbackHttpServer
) -> None:
    with pytest.raises(UrlValidationError, match="http:// URLs are not allowed"):
        await client.fetch_bytes(server.url("payload"), 5.0, policy=UrlValidationPolicy())
    permissive_scheme = UrlValidationPolicy(allow_http=True)
    with pytest.raises(UrlValidationError, match=r"IP literal '127\.0\.0\.1' is in a blocked"):
        await client.fetch_bytes(server.url("payload"), 5.0, policy=permissive_scheme)
    assert server.requests == []


async def test_close_is_idempotent_and_the_client_reopens(
    client: HttpClient, server: LoopbackHttpServer
) -> None:
    assert await client.fetch_bytes(server.url("payload"), 5.0) == PAYLOAD
    await client.close()
    await client.close()
    assert await client.fetch_bytes(server.url("payload"), 5.0) == PAYLOAD


# --- the process-wide facade --------------------------------------------------------------


@pytest.fixture
async def fresh_default(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    await close_http_client()
    yield
    await close_http_client()


@pytest.mark.usefixtures("fresh_default")
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, AiohttpClient),
        ("", AiohttpClient),
        ("aiohttp", AiohttpClient),
        ("HTTPX", HttpxClient),
    ],
)
async def test_backend_selection(
    monkeypatch: pytest.MonkeyPatch, value: str | None, expected: type[HttpClient]
) -> None:
    if value is None:
        monkeypatch.delenv("DYN_HTTP_BACKEND", raising=False)
    else:
        monkeypatch.setenv("DYN_HTTP_BACKEND", value)
    first = get_default_client()
    assert type(first) is expected
    assert get_default_client() is first


@pytest.mark.usefixtures("fresh_default")
async def test_unknown_backend_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_HTTP_BACKEND", "curl")
    with pytest.raises(ValueError, match=r"DYN_HTTP_BACKEND='curl' is not supported; use one of"):
        get_default_client()


@pytest.mark.usefixtures("fresh_default")
async def test_fetch_bytes_facade_and_reset(
    monkeypatch: pytest.MonkeyPatch, server: LoopbackHttpServer
) -> None:
    monkeypatch.setenv("DYN_HTTP_BACKEND", "httpx")
    assert await fetch_bytes(server.url("payload"), 5.0, policy=loopback_policy()) == PAYLOAD
    assert isinstance(get_default_client(), HttpxClient)
    await close_http_client()
    await close_http_client()  # idempotent
    monkeypatch.setenv("DYN_HTTP_BACKEND", "aiohttp")
    assert isinstance(get_default_client(), AiohttpClient)  # env read again after a reset
    with pytest.raises(UrlValidationError):
        await fetch_bytes(server.url("payload"), 5.0, policy=UrlValidationPolicy())


def test_http_status_error_fields() -> None:
    error = HttpStatusError(404, "Not Found", "https://example.com/a.png")
    assert (error.status, error.message, error.url) == (
        404,
        "Not Found",
        "https://example.com/a.png",
    )
    assert str(error) == "HTTP 404 for https://example.com/a.png: Not Found"
    data_url = "data:image/png;base64," + "A" * 10_000
    assert "payload elided" in str(HttpStatusError(415, "Unsupported Media Type", data_url))


def test_error_hierarchy() -> None:
    for cls in (HttpStatusError, HttpTimeoutError, HttpConnectionError):
        assert issubclass(cls, HttpError)
    assert issubclass(UrlValidationError, ValueError)


def test_http_client_is_abstract() -> None:
    with pytest.raises(TypeError, match="abstract"):
        HttpClient()  # type: ignore[abstract]
