"""Leader election's write fence on aiohttp sessions (kopf's and the worker pods' clients).

`WriteFence(check)` is an aiohttp client middleware: before a request that can change
something (anything but GET and HEAD) it calls `check`, which raises
`k8s.election.NotLeader` once this replica may no longer write. The refusal surfaces as an
`aiohttp.ClientConnectionError` (`FencedRequest`), which both clients already treat as "no
answer, try again later" (and the replica stops within a retry period anyway).

kopf's own patches (finalizers, progress annotations) and Events go through the session its
login handler returns (`kopf_session`, from `handlers.lifecycle`), the operator's own API
writes through `k8s.client.Cluster`'s fence, and the worker pods' admin calls through the
operator context's session.

`kopf_session` also bounds kopf's connections, which kopf's own session does not: kopf patches
every new object at once, so 500 DynamoWorkers applied together opened about 200 TLS
connections side by side, and their buffers stayed in the operator's RSS after the burst.
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp
import kopf

from dynamo_operator.k8s.election import NotLeader

READ_METHODS = frozenset({"GET", "HEAD"})


class FencedRequest(aiohttp.ClientConnectionError):
    """A write refused before it was sent: this replica does not lead (any more)."""


class WriteFence:
    """An aiohttp client middleware refusing writes unless `check()` passes."""

    def __init__(self, check: Callable[[], None]) -> None:
        self._check = check

    async def __call__(
        self, request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
    ) -> aiohttp.ClientResponse:
        if request.method not in READ_METHODS:
            try:
                self._check()
            except NotLeader as exc:
                raise FencedRequest(f"{request.method} {request.url.path}: {exc}") from None
        return await handler(request)


def kopf_session(
    info: kopf.ConnectionInfo, connections: int, fence: Callable[[], None] | None
) -> kopf.AiohttpSession:
    """kopf's connection `info` as the session kopf would build from it (TLS, headers with basic
    auth, proxy), with at most `connections` connections open (0: no bound) and, under leader
    election, `WriteFence(fence)` in front (in the event loop: an async login)."""
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, ssl=info.as_ssl_context()),
        headers=info.as_http_headers(),
        proxy=info.proxy_url,
        trust_env=info.trust_env,
        middlewares=() if fence is None else (WriteFence(fence),),
    )
    return kopf.AiohttpSession(
        server=info.server,
        priority=info.priority,
        default_namespace=info.default_namespace,
        expiration=info.expiration,
        aiohttp_session=session,
    )
