"""The HTTP clients' seams that code written for upstream's `dynamo.common` relies on.

Upstream's tests (and callers that tune the client) put their own session on the client
object, `AiohttpClient._session` or `HttpxClient._client`, and expect every fetch to go
through it: no connection of the client's own is opened. A session set that way must also
see the same error mapping as a real one. Where upstream's 1.6.1 client has the same
behaviour, the same scenarios run against it in its own venv and the outcomes must match.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any
from unittest.mock import MagicMock

import aiohttp
import httpx
import pytest
from yarl import URL

from dynamo.common.http import (
    AiohttpClient,
    HttpConnectionError,
    HttpStatusError,
    HttpTimeoutError,
    HttpxClient,
    UrlValidationPolicy,
)
from support.upstream import run_json_driver, upstream_python

pytestmark = pytest.mark.unit

# Lets every host through without DNS, so no fetch below depends on the network.
OPEN_POLICY = UrlValidationPolicy(allow_http=True, allow_private_ips=True)

# --- aiohttp: a session double set as `client._session` --------------------------------------


class _Response:
    """What `async with session.get(...) as response` yields, reduced to what a fetch reads."""

    def __init__(
        self, status: int = 200, body: bytes = b"", location: str | None = None, url: str = ""
    ) -> None:
        self.status = status
        self.reason = "Reason"
        self.headers = {"Location": location} if location is not None else {}
        self.url = URL(url)
        self._body = body

    async def read(self) -> bytes:
        return self._body


Outcome = _Response | BaseException


class _Request:
    """The async context manager `session.get` returns: yields a response or raises."""

    def __init__(self, outcome: Outcome) -> None:
        self._outcome = outcome

    async def __aenter__(self) -> _Response:
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome

    async def __aexit__(self, *exc_info: object) -> None:
        return None


def _session_double(outcomes: dict[str, Outcome], requested: list[str]) -> MagicMock:
    """An `aiohttp.ClientSession` look-alike answering each URL from `outcomes`."""

    def get(url: str, **_: Any) -> _Request:
        requested.append(str(url))
        return _Request(outcomes[str(url)])

    session = MagicMock(spec=aiohttp.ClientSession)
    session.closed = False
    session.get = get
    return session


def _response_error(status: int) -> aiohttp.ClientResponseError:
    return aiohttp.ClientResponseError(
        request_info=MagicMock(), history=(), status=status, message="Not Found"
    )


@pytest.mark.parametrize("policy", [None, OPEN_POLICY], ids=["native", "policy"])
async def test_aiohttp_fetches_through_a_session_set_on_the_client(
    policy: UrlValidationPolicy | None,
) -> None:
    requested: list[str] = []
    client = AiohttpClient()
    session = _session_double({"https://media.test/a": _Response(body=b"hello")}, requested)
    client._session = session
    assert await client.fetch_bytes("https://media.test/a", 5.0, policy=policy) == b"hello"
    assert requested == ["https://media.test/a"]
    # Still the caller's session: using it did not swap in one of the client's own.
    assert client._session is session


@pytest.mark.parametrize("policy", [None, OPEN_POLICY], ids=["native", "policy"])
@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (_response_error(404), HttpStatusError),
        (TimeoutError(), HttpTimeoutError),
        (aiohttp.ServerTimeoutError("slow"), HttpTimeoutError),
        (aiohttp.ClientConnectionError("refused"), HttpConnectionError),
    ],
    ids=["response-error", "timeout", "server-timeout", "connection"],
)
async def test_aiohttp_maps_what_the_session_raises(
    policy: UrlValidationPolicy | None, raised: BaseException, expected: type[Exception]
) -> None:
    client = AiohttpClient()
    client._session = _session_double({"https://media.test/a": raised}, [])
    with pytest.raises(expected) as caught:
        await client.fetch_bytes("https://media.test/a", 5.0, policy=policy)
    assert caught.value.__cause__ is raised
    if isinstance(raised, aiohttp.ClientResponseError):
        # The server's status survives the mapping.
        assert isinstance(caught.value, HttpStatusError)
        assert caught.value.status == 404


async def test_aiohttp_policy_redirects_resolve_against_the_response_url() -> None:
    requested: list[str] = []
    client = AiohttpClient()
    client._session = _session_double(
        {
            "https://media.test/dir/a": _Response(
                302, location="../b", url="https://media.test/dir/a"
            ),
            "https://media.test/b": _Response(body=b"final"),
        },
        requested,
    )
    assert await client.fetch_bytes("https://media.test/dir/a", 5.0, policy=OPEN_POLICY) == (
        b"final"
    )
    assert requested == ["https://media.test/dir/a", "https://media.test/b"]


async def test_aiohttp_close_closes_a_session_set_on_the_client() -> None:
    client = AiohttpClient()
    session = MagicMock(spec=aiohttp.ClientSession)
    session.closed = False
    client._session = session
    await client.close()
    session.close.assert_awaited_once()
    assert client._session is None


# --- httpx: an `httpx.AsyncClient` set as `client._client` ------------------------------------


def _mock_transport_client(
    handler: Callable[[httpx.Request], httpx.Response], requested: list[str]
) -> httpx.AsyncClient:
    """A real httpx client whose transport answers from `handler`; no socket is opened."""

    def record(request: httpx.Request) -> httpx.Response:
        requested.append(str(request.url))
        return handler(request)

    return httpx.AsyncClient(transport=httpx.MockTransport(record), follow_redirects=True)


@pytest.fixture
async def httpx_client() -> AsyncIterator[HttpxClient]:
    client = HttpxClient()
    yield client
    await client.close()


@pytest.mark.parametrize("policy", [None, OPEN_POLICY], ids=["native", "policy"])
async def test_httpx_fetches_through_a_client_set_on_the_object(
    httpx_client: HttpxClient, policy: UrlValidationPolicy | None
) -> None:
    requested: list[str] = []
    inner = _mock_transport_client(lambda _: httpx.Response(200, content=b"hello"), requested)
    httpx_client._client = inner
    assert await httpx_client.fetch_bytes("https://media.test/a", 5.0, policy=policy) == b"hello"
    assert requested == ["https://media.test/a"]
    assert httpx_client._client is inner


@pytest.mark.parametrize("policy", [None, OPEN_POLICY], ids=["native", "policy"])
async def test_httpx_statuses_through_a_set_client(
    httpx_client: HttpxClient, policy: UrlValidationPolicy | None
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/missing":
            return httpx.Response(404)
        # A 3xx without Location is a terminal response, not an error, in both backends.
        return httpx.Response(300, content=b"choices")

    httpx_client._client = _mock_transport_client(handler, [])
    with pytest.raises(HttpStatusError) as caught:
        await httpx_client.fetch_bytes("https://media.test/missing", 5.0, policy=policy)
    assert caught.value.status == 404
    assert isinstance(caught.value.__cause__, httpx.HTTPStatusError)
    assert await httpx_client.fetch_bytes("https://media.test/c", 5.0, policy=policy) == (
        b"choices"
    )


async def test_httpx_policy_redirects_resolve_through_a_set_client(
    httpx_client: HttpxClient,
) -> None:
    requested: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/dir/a":
            return httpx.Response(307, headers={"Location": "../b"})
        return httpx.Response(200, content=b"final")

    httpx_client._client = _mock_transport_client(handler, requested)
    body = await httpx_client.fetch_bytes("https://media.test/dir/a", 5.0, policy=OPEN_POLICY)
    assert body == b"final"
    assert requested == ["https://media.test/dir/a", "https://media.test/b"]


@pytest.mark.parametrize("policy", [None, OPEN_POLICY], ids=["native", "policy"])
@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (httpx.ConnectTimeout("slow"), HttpTimeoutError),
        (httpx.ConnectError("refused"), HttpConnectionError),
    ],
    ids=["timeout", "connection"],
)
async def test_httpx_maps_what_the_set_client_raises(
    httpx_client: HttpxClient,
    policy: UrlValidationPolicy | None,
    raised: httpx.HTTPError,
    expected: type[Exception],
) -> None:
    def handler(_: httpx.Request) -> httpx.Response:
        raise raised

    httpx_client._client = _mock_transport_client(handler, [])
    with pytest.raises(expected) as caught:
        await httpx_client.fetch_bytes("https://media.test/a", 5.0, policy=policy)
    assert caught.value.__cause__ is raised


async def test_httpx_judges_status_by_raise_for_status(httpx_client: HttpxClient) -> None:
    # A response double that stubs `raise_for_status` and nothing about its status code, as
    # upstream's tests build them, is read as a success.
    response = MagicMock(spec=httpx.Response)
    response.content = b"hello"
    response.raise_for_status = MagicMock(return_value=None)
    inner = MagicMock(spec=httpx.AsyncClient)
    inner.is_closed = False
    inner.get = MagicMock(side_effect=lambda *_, **__: asyncio.sleep(0, response))
    httpx_client._client = inner
    assert await httpx_client.fetch_bytes("https://media.test/a", 5.0) == b"hello"


# --- against upstream's 1.6.1 AiohttpClient -----------------------------------------------------

# Runs unchanged in both venvs. 1.6.1 keeps one session per connect-time policy in
# `_sessions`; this project keeps one in `_session`. Each scenario maps URLs to a response
# (status, body, Location) or to an exception the session's request raises.
_DRIVER = """
import asyncio, json
from unittest.mock import MagicMock
import aiohttp
from yarl import URL
from dynamo.common import http
from dynamo.common.http.url_validator import UrlValidationPolicy

class Response:
    def __init__(self, status, body, location, url):
        self.status, self.reason, self._body, self.url = status, "Reason", body, URL(url)
        self.headers = {"Location": location} if location else {}
        async def chunks(size):
            yield body
        self.content = MagicMock(iter_chunked=chunks)
    def raise_for_status(self):
        if self.status >= 400:
            raise aiohttp.ClientResponseError(
                request_info=MagicMock(), history=(), status=self.status, message="bad")
    async def read(self):
        return self._body

def outcome(spec, url):
    kind = spec[0]
    if kind == "response":
        return Response(spec[1], spec[2].encode(), spec[3], url)
    if kind == "response_error":
        return aiohttp.ClientResponseError(
            request_info=MagicMock(), history=(), status=spec[1], message="bad")
    return {"timeout": TimeoutError(), "connection": aiohttp.ClientConnectionError("no")}[kind]

class Request:
    def __init__(self, value):
        self.value = value
    async def __aenter__(self):
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value
    async def __aexit__(self, *exc_info):
        return False

async def run(case):
    session = MagicMock(spec=aiohttp.ClientSession)
    session.closed = False
    session.get = lambda url, **kw: Request(outcome(case["urls"][str(url)], str(url)))
    client = http.AiohttpClient()
    if hasattr(client, "_sessions"):
        client._sessions = {True: session, False: session}
    else:
        client._session = session
    policy = None
    if case["policy"]:
        policy = UrlValidationPolicy(allow_http=True, allow_private_ips=True)
    try:
        return ["body", (await client.fetch_bytes(case["url"], 5.0, policy=policy)).decode()]
    except http.HttpStatusError as exc:
        return ["HttpStatusError", exc.status]
    except http.HttpError as exc:
        return [type(exc).__name__, None]

async def main():
    print(json.dumps([await run(case) for case in json.loads(input())]))

asyncio.run(main())
"""

_A = "https://media.test/a"
_SCENARIOS: list[tuple[bool, dict[str, list[Any]]]] = [
    *(
        (policy, urls)
        for policy in (False, True)
        for urls in (
            {_A: ["response", 200, "hello", None]},
            {_A: ["response", 404, "", None]},
            {_A: ["response", 503, "", None]},
            {_A: ["timeout"]},
            {_A: ["connection"]},
        )
    ),
    # Only where 1.6.1 maps it the same way: in its policy path a response error raised
    # by the session itself surfaces as a connection error, here as the status error.
    (False, {_A: ["response_error", 404]}),
    (
        True,
        {
            _A: ["response", 302, "", "/b"],
            "https://media.test/b": ["response", 200, "final", None],
        },
    ),
    (True, {_A: ["response", 302, "", None]}),
]


def _run_driver(python: str) -> list[Any]:
    cases = [{"url": _A, "policy": policy, "urls": urls} for policy, urls in _SCENARIOS]
    # 1.6.1 refuses a policy-checked fetch an ambient egress proxy would carry.
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.pop("DYN_MM_ALLOW_INTERNAL", None)
    outcomes: list[Any] = run_json_driver(python, _DRIVER, cases, env)
    return outcomes


def test_aiohttp_session_double_outcomes_match_upstream() -> None:
    upstream = _run_driver(str(upstream_python()))
    ours = _run_driver(sys.executable)
    for scenario, mine, theirs in zip(_SCENARIOS, ours, upstream, strict=True):
        assert mine == theirs, f"policy={scenario[0]} {scenario[1]}"
