"""kopf settings, startup and cleanup, login, and the liveness probes.

Settings are deliberate rather than kopf's defaults:
- our finalizer name and `dynamo.dev/` annotations for kopf's progress records (changing
  storage later can duplicate work, so they are fixed from day one);
- no diff base (`NoDiffBase`): no handler reacts to a diff (no create, update or resume
  handler; each kind's daemon reconciles, woken by watch events), so storing kopf's
  last-handled-configuration annotation would cost one PATCH per object for nothing;
- only WARNING and above from kopf's own log become Kubernetes Events (the reconciler
  records its own Events for condition transitions);
- watches: the API server is asked to end each watch after `WATCH_SERVER_TIMEOUT_SECONDS`
  (kopf re-watches from the last resourceVersion), the client gives up a little later, and
  a stream silent for `WATCH_INACTIVITY_SECONDS` (no event and no bookmark) is reconnected;
- API errors (5xx, 429, 403, connection errors): kopf retries each of its requests for
  `API_RETRY_WINDOW_SECONDS`, at most `API_RETRY_CAP_SECONDS` apart (`api_error_backoffs`).
  Its default gives up after 9 tries over 54 s, and a request it gives up on ends the object's
  event worker and drops the events queued behind it: a finalizer PATCH lost in a burst of
  errors left the finalizer missing on a Ready DynamoWorker, or stuck on a deleted one, until
  the object's next change (which a deleted one never gets);
- standalone: no kopf peering objects; with several replicas, one leads through a Lease and
  the others run no kopf at all (`handlers.leadership`, which says why not kopf's peering);
- the watches of pods and of the operator's children ask the API server for the labels the
  handlers select (`indices.restrict_watches`);
- kopf's connections are bounded (`kopf_connections`): one per watch and a few for its
  patches and Events, where kopf's own session opens one per object being handled at once;
- no cluster scanning: the operator's resources are discovered once at startup, after it has
  installed its CRDs, so it needs no cluster-wide CRD and namespace watch permissions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import Any

import kopf

from dynamo_operator.handlers.context import OperatorContext
from dynamo_operator.handlers.fence import kopf_session
from dynamo_operator.handlers.indices import WATCHED_RESOURCES, restrict_watches
from dynamo_operator.handlers.settings import OperatorConfig

ANNOTATION_PREFIX = "dynamo.dev"
FINALIZER = f"{ANNOTATION_PREFIX}/finalizer"
WATCH_SERVER_TIMEOUT_SECONDS = 300
WATCH_CLIENT_TIMEOUT_SECONDS = 330
WATCH_CONNECT_TIMEOUT_SECONDS = 30
WATCH_INACTIVITY_SECONDS = 70
REQUEST_TIMEOUT_SECONDS = 60
API_RETRY_WINDOW_SECONDS = 300.0
API_RETRY_CAP_SECONDS = 5.0
# After this long, the watchers for DynamoWorkers must exist, or the liveness probe fails.
WATCHER_STARTUP_GRACE_SECONDS = 30.0
ANY_WATCHER_PREFIX = "watcher for "
WATCHER_TASK_PREFIX = f"{ANY_WATCHER_PREFIX}dynamoworkers.v1alpha1.dynamo.dev@"
# kopf's requests other than its watches (patches, Events) share this many connections.
KOPF_REQUEST_CONNECTIONS = 32


def api_error_backoffs() -> tuple[float, ...]:
    """Pauses between kopf's tries of a failed request: growing to `API_RETRY_CAP_SECONDS`,
    `API_RETRY_WINDOW_SECONDS` in all (a 429's Retry-After lengthens a pause, never shortens
    it)."""
    pauses = [1.0, 1.0, 2.0, 3.0]
    while sum(pauses) < API_RETRY_WINDOW_SECONDS:
        pauses.append(min(API_RETRY_CAP_SECONDS, pauses[-1] + pauses[-2]))
    return tuple(pauses)


def kopf_connections(config: OperatorConfig) -> int:
    """The connections kopf's session may open: one held by each watch (every watched resource
    in every namespace; one cluster-wide watch each with --all-namespaces), so that no watch
    waits for a connection, and `KOPF_REQUEST_CONNECTIONS` more for everything else."""
    namespaces = 1 if config.all_namespaces else max(1, len(config.namespaces))
    return len(WATCHED_RESOURCES) * namespaces + KOPF_REQUEST_CONNECTIONS


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf's diff-base storage that stores nothing: every object looks new to kopf, which
    matters only to create, update and resume handlers, and this operator has none (a unit
    test holds the registry to that)."""

    def fetch(self, *, body: kopf.Body) -> None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


def operator_settings() -> kopf.OperatorSettings:
    """kopf's settings for this operator."""
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = WATCH_SERVER_TIMEOUT_SECONDS
    settings.watching.client_timeout = WATCH_CLIENT_TIMEOUT_SECONDS
    settings.watching.connect_timeout = WATCH_CONNECT_TIMEOUT_SECONDS
    settings.watching.inactivity_timeout = WATCH_INACTIVITY_SECONDS
    settings.networking.request_timeout = REQUEST_TIMEOUT_SECONDS
    settings.networking.connect_timeout = WATCH_CONNECT_TIMEOUT_SECONDS
    settings.networking.error_backoffs = api_error_backoffs()
    settings.peering.standalone = True
    settings.scanning.disabled = True
    restrict_watches(settings)
    return settings


def watcher_problem(
    task_names: list[str], namespaces: tuple[str, ...], seen: frozenset[str] = frozenset()
) -> str | None:
    """Why the watchers look dead, or None: no DynamoWorker watcher in a namespace, or a
    watcher task in `seen` (every one that ran) that is gone. kopf ends a watcher for good when
    its watch fails outright (a 404 while a CRD is replaced, say) and never starts it again."""
    running = {
        n[len(WATCHER_TASK_PREFIX) :] for n in task_names if n.startswith(WATCHER_TASK_PREFIX)
    }
    expected = set(namespaces) if namespaces else {"None"}
    missing = sorted(expected - running)
    if missing:
        return f"no DynamoWorker watch is running for namespace(s) {', '.join(missing)}"
    stopped = sorted(seen - set(task_names))
    if stopped:
        names = ", ".join(n[len(ANY_WATCHER_PREFIX) :] for n in stopped)
        return f"watches stopped, which kopf does not start again: {names}"
    return None


def in_cluster_server(default: str) -> str:
    """The API server's address from the environment the kubelet sets, as client-go's
    in-cluster config takes it; `default` (kopf's `https://kubernetes.default.svc`, which
    needs cluster DNS) only when the environment does not say."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        return default
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def register(registry: kopf.OperatorRegistry) -> None:
    """Register startup, cleanup, login and probes on `registry`."""

    @kopf.on.login(id="login", registry=registry)
    async def login(
        memo: OperatorContext, **kwargs: Any
    ) -> kopf.ConnectionInfo | kopf.AiohttpSession | None:
        info = kopf.login_with_service_account(**kwargs)
        if info is not None:
            info = dataclasses.replace(info, server=in_cluster_server(info.server))
        else:
            info = kopf.login_with_kubeconfig(**kwargs)
        if info is None:
            return None
        # Under leader election, kopf's own writes (finalizers, annotations, Events) pass the
        # fence.
        return kopf_session(info, kopf_connections(memo.config), memo.fence)

    @kopf.on.startup(id="start", registry=registry)
    async def start(memo: OperatorContext, **_: Any) -> None:
        await memo.start()

    @kopf.on.cleanup(id="stop", registry=registry)
    async def stop(memo: OperatorContext, **_: Any) -> None:
        await memo.stop()

    @kopf.on.probe(id="watching", registry=registry)
    async def watching(memo: OperatorContext, **_: Any) -> str:
        if time.monotonic() - memo.started_at < WATCHER_STARTUP_GRACE_SECONDS:
            return "starting"
        problem = liveness_problem(memo)
        if problem is not None:
            raise kopf.PermanentError(problem)
        return "ok"


def liveness_problem(memo: OperatorContext) -> str | None:
    """Why the running operator should be restarted, or None (also the leader's `/healthz`
    with leader election, `handlers.leadership`)."""
    # A watcher task that died leaves the operator running but deaf (kopf #1276); only a
    # restart brings it back, so the liveness probe fails.
    if time.monotonic() - memo.started_at < WATCHER_STARTUP_GRACE_SECONDS:
        return None
    names = [task.get_name() for task in asyncio.all_tasks()]
    memo.watchers |= {n for n in names if n.startswith(ANY_WATCHER_PREFIX)}
    return watcher_problem(names, memo.config.namespaces, memo.watchers)
