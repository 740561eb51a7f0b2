"""Who may change this worker: Kubernetes authentication and authorization on the mutating
system routes, as kube-rbac-proxy and controller-runtime's metrics filter do it.

The caller sends `Authorization: Bearer <token>`, a Kubernetes token minted for the audience
`dynamo.dev/worker-admin` (a token for another audience, such as the default one every pod
mounts, is refused). The worker asks the API server who that is (TokenReview), then whether
they may `update` the `dynamoworkers/admin` subresource of its DynamoWorker in its namespace
(LocalSubjectAccessReview, which the worker's own Role grants in that namespace only).
Decisions are cached for `CACHE_SECONDS` per token.

Guarded (`is_admin_route`): every `/engine/*` route (controls, updates, the RL admin routes)
and `POST`/`DELETE /v1/loras`. Open: probes, `/metrics`, `/metadata`, `GET /v1/loras` and
the model-card files, which upstream's frontend reads without a token and which reveal no
credential.

Answers: 401 without a token or with one the API server does not accept for the audience,
403 when the caller may not, 503 when the API server cannot be asked; each a JSON body
saying what is missing. Off unless `DYN_SYSTEM_ADMIN_AUTH=kubernetes` (the operator sets it
in every worker pod it makes; `dynamo-worker --system-admin-auth kubernetes` elsewhere).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamo.runtime.kube_api import api_client

logger = logging.getLogger(__name__)

AUDIENCE = "dynamo.dev/worker-admin"
GROUP, RESOURCE, SUBRESOURCE, VERB = "dynamo.dev", "dynamoworkers", "admin", "update"
CACHE_SECONDS = 10.0
CACHE_ENTRIES = 1024
ENV_MODE = "DYN_SYSTEM_ADMIN_AUTH"
ENV_WORKER = "DYN_SYSTEM_ADMIN_AUTH_WORKER"
MODES = ("off", "kubernetes")
_READ_METHODS = frozenset({"GET", "HEAD"})


def is_admin_route(method: str, path: str) -> bool:
    """Whether `method path` (a route's canonical path) changes the worker, and so needs an
    authorized caller."""
    if path == "/engine" or path.startswith("/engine/"):
        return True
    if path == "/v1/loras" or path.startswith("/v1/loras/"):
        return method.upper() not in _READ_METHODS
    return False


@dataclass(frozen=True)
class Identity:
    """A caller as TokenReview reports them."""

    username: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()


@dataclass(frozen=True)
class Decision:
    """The answer for one token: `status` 200 (allowed), 401 or 403, and why."""

    status: int
    message: str
    username: str = ""


class Reviewer(Protocol):
    """The API server's two questions (a fake stands in for it in unit tests)."""

    async def authenticate(self, token: str, audience: str) -> Identity | str:
        """The token's identity, or why it is not accepted."""
        ...

    async def authorize(self, who: Identity, attributes: Mapping[str, str]) -> tuple[bool, str]:
        """Whether `who` may do `attributes` (a SubjectAccessReview's resourceAttributes)."""
        ...

    async def close(self) -> None:
        """Release the connection to the API server."""
        ...


class ReviewUnavailable(Exception):
    """The API server could not be asked (not the caller's fault; answered 503)."""


class KubernetesReviewer:
    """TokenReview and LocalSubjectAccessReview with the worker's own service account."""

    def __init__(
        self,
        namespace: str,
        *,
        connect: Callable[[], Awaitable[client.ApiClient]] = api_client,
    ) -> None:
        self._namespace = namespace
        self._connect = connect
        self._api: client.ApiClient | None = None

    async def authenticate(self, token: str, audience: str) -> Identity | str:
        body = client.V1TokenReview(
            spec=client.V1TokenReviewSpec(token=token, audiences=[audience])
        )
        try:
            review = await client.AuthenticationV1Api(await self._client()).create_token_review(
                body
            )
        except ApiException as exc:
            raise ReviewUnavailable(_api_error("TokenReview", exc)) from exc
        status = review.status
        if status is None or not status.authenticated or status.user is None:
            error = status.error if status is not None and status.error else ""
            return error or "the token is not valid"
        if audience not in (status.audiences or []):
            return f"the token is not for the audience {audience!r}"
        user = status.user
        extra = tuple(sorted((k, tuple(v)) for k, v in (user.extra or {}).items()))
        return Identity(user.username or "", user.uid or "", tuple(user.groups or ()), extra)

    async def authorize(self, who: Identity, attributes: Mapping[str, str]) -> tuple[bool, str]:
        spec: dict[str, Any] = {"user": who.username, "resourceAttributes": dict(attributes)}
        if who.uid:
            spec["uid"] = who.uid
        if who.groups:
            spec["groups"] = list(who.groups)
        if who.extra:
            spec["extra"] = {k: list(v) for k, v in who.extra}
        body: Any = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "LocalSubjectAccessReview",
            "metadata": {"namespace": self._namespace},
            "spec": spec,
        }
        api = client.AuthorizationV1Api(await self._client())
        try:
            review = await api.create_namespaced_local_subject_access_review(self._namespace, body)
        except ApiException as exc:
            raise ReviewUnavailable(_api_error("LocalSubjectAccessReview", exc)) from exc
        status = review.status
        return bool(status and status.allowed), (status.reason or "") if status else ""

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
            self._api = None

    async def _client(self) -> client.ApiClient:
        if self._api is None:
            self._api = await self._connect()
        return self._api


def _api_error(what: str, exc: ApiException) -> str:
    if exc.status == 403:
        return (
            f"the worker may not create {what}s: its service account needs the operator's "
            "worker Role (localsubjectaccessreviews) and the chart's token-review binding"
        )
    return f"{what} failed: HTTP {exc.status} {exc.reason}"


class AdminAuth:
    """The decision for a request to an admin route, cached per token."""

    def __init__(
        self,
        reviewer: Reviewer,
        namespace: str,
        worker: str | None = None,
        *,
        cache_seconds: float = CACHE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._reviewer = reviewer
        self._attributes = {
            "namespace": namespace,
            "group": GROUP,
            "resource": RESOURCE,
            "subresource": SUBRESOURCE,
            "verb": VERB,
        }
        if worker:
            self._attributes["name"] = worker
        self._cache_seconds = cache_seconds
        self._clock = clock
        self._cache: dict[str, tuple[float, Decision]] = {}

    @property
    def permission(self) -> str:
        """What a caller needs, in words (for 403 bodies and logs)."""
        a = self._attributes
        target = f"{a['resource']}/{a['subresource']}"
        named = f" {a['name']!r}" if "name" in a else ""
        return f"{a['verb']} on {target}{named} ({a['group']}) in namespace {a['namespace']!r}"

    async def close(self) -> None:
        await self._reviewer.close()

    async def decide(self, authorization: str | None) -> Decision:
        """The decision for an `Authorization` header value (None when absent)."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return Decision(
                401,
                "missing bearer token: send 'Authorization: Bearer <token>' with a Kubernetes "
                f"service-account token for the audience {AUDIENCE!r}",
            )
        key = hashlib.sha256(token.encode()).hexdigest()
        now = self._clock()
        cached = self._cache.get(key)
        if cached is not None and now - cached[0] < self._cache_seconds:
            return cached[1]
        decision = await self._review(token)
        if len(self._cache) >= CACHE_ENTRIES:
            self._cache = {k: v for k, v in self._cache.items() if now - v[0] < self._cache_seconds}
            if len(self._cache) >= CACHE_ENTRIES:
                self._cache.clear()
        self._cache[key] = (now, decision)
        return decision

    async def _review(self, token: str) -> Decision:
        who = await self._reviewer.authenticate(token, AUDIENCE)
        if isinstance(who, str):
            return Decision(401, f"invalid bearer token ({who}); it must be for {AUDIENCE!r}")
        allowed, reason = await self._reviewer.authorize(who, self._attributes)
        if not allowed:
            because = f": {reason}" if reason else ""
            return Decision(
                403, f"{who.username} may not change this worker; needs {self.permission}{because}",
                who.username,
            )  # fmt: skip
        return Decision(200, "allowed", who.username)


def install(app: web.Application, auth: AdminAuth) -> None:
    """Guard `app`'s admin routes with `auth` (closed with the app)."""
    app.middlewares.append(middleware(auth))

    async def close(_: web.Application) -> None:
        await auth.close()

    app.on_cleanup.append(close)


def middleware(auth: AdminAuth) -> Any:
    """An aiohttp middleware answering admin routes only for authorized callers."""

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        # Judged by the route that will answer (not the raw path), so no spelling of a path
        # reaches an admin handler unchecked.
        resource = request.match_info.route.resource
        path = resource.canonical if resource is not None else request.path
        if not is_admin_route(request.method, path):
            return await handler(request)
        try:
            decision = await auth.decide(request.headers.get("Authorization"))
        except ReviewUnavailable as exc:
            logger.warning("%s %s: cannot check the caller: %s", request.method, request.path, exc)
            return _refusal(503, "Service Unavailable", f"cannot check the caller: {exc}")
        if decision.status != 200:
            logger.info(
                "%s %s refused (%d): %s", request.method, request.path, decision.status,
                decision.message,
            )  # fmt: skip
            error = "Unauthorized" if decision.status == 401 else "Forbidden"
            return _refusal(decision.status, error, decision.message)
        return await handler(request)

    return check


def _refusal(status: int, error: str, message: str) -> web.Response:
    headers = {"WWW-Authenticate": 'Bearer realm="dynamo-worker"'} if status == 401 else None
    return web.json_response({"error": error, "message": message}, status=status, headers=headers)


def from_env(environ: Mapping[str, str] = os.environ) -> AdminAuth | None:
    """The admin-route check `DYN_SYSTEM_ADMIN_AUTH` asks for, or None when off."""
    mode = (environ.get(ENV_MODE) or "off").strip().lower()
    if mode not in MODES:
        raise ValueError(f"{ENV_MODE}={mode!r}: use one of {', '.join(MODES)}")
    if mode == "off":
        return None
    namespace = environ.get("POD_NAMESPACE")
    if not namespace:
        raise ValueError(
            f"{ENV_MODE}=kubernetes needs POD_NAMESPACE (the downward API's metadata.namespace):"
            " callers are authorized in the worker's namespace"
        )
    reviewer = KubernetesReviewer(namespace, connect=lambda: api_client(environ))
    return AdminAuth(reviewer, namespace, environ.get(ENV_WORKER) or None)
