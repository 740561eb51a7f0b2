"""The kopf glue without a cluster: settings chosen on purpose, every handler registered with a
stable id, the liveness check on watchers, the indices' view, the resync loop, and the `run`
command line."""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any, Literal

import kopf
import pytest
from kopf._cogs.aiokits.aioenums import FlagSetter

from dynamo_operator import cli
from dynamo_operator.api.metadata import DynamoWorkerMetadata
from dynamo_operator.handlers import OperatorConfig, OperatorContext, build_registry
from dynamo_operator.handlers.indices import (
    CHILD_KINDS,
    WATCHED_RESOURCES,
    Indices,
    child_index_id,
)
from dynamo_operator.handlers.lifecycle import (
    API_RETRY_CAP_SECONDS,
    API_RETRY_WINDOW_SECONDS,
    FINALIZER,
    KOPF_REQUEST_CONNECTIONS,
    NoDiffBase,
    api_error_backoffs,
    kopf_connections,
    operator_settings,
    watcher_problem,
)
from dynamo_operator.handlers.resync import resync_loop
from dynamo_operator.k8s import kinds
from dynamo_operator.reconcile.children import CachedChild
from dynamo_operator.reconcile.dynamoworker.pod_summary import PodSummary
from dynamo_operator.reconcile.loraadapter.targeting import WorkerInfo

pytestmark = pytest.mark.unit


def test_settings_use_our_names_and_deliberate_timeouts() -> None:
    settings = operator_settings()
    assert settings.persistence.finalizer == "dynamo.dev/finalizer"
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert settings.persistence.progress_storage.prefix == "dynamo.dev"
    assert isinstance(settings.persistence.diffbase_storage, NoDiffBase)
    assert settings.posting.level == logging.WARNING
    assert settings.peering.standalone is True
    assert settings.scanning.disabled is True
    assert settings.watching.server_timeout == 300
    assert settings.watching.client_timeout == 330
    assert settings.watching.inactivity_timeout == 70
    assert settings.networking.request_timeout == 60
    # The API server sends only worker pods and the operator's own children.
    selectors = {
        str(getattr(k, "any_name", "")): v for k, v in settings.watching.label_selectors.items()
    }
    assert selectors.pop("pods") == (
        "app.kubernetes.io/component=worker,app.kubernetes.io/managed-by=dynamo-operator"
    )
    assert set(selectors) == {k.plural for k in CHILD_KINDS}
    assert set(selectors.values()) == {"app.kubernetes.io/managed-by=dynamo-operator"}


def test_kopf_retries_api_errors_for_minutes_at_most_a_cap_apart() -> None:
    pauses = api_error_backoffs()
    assert operator_settings().networking.error_backoffs == pauses
    assert pauses[:4] == (1.0, 1.0, 2.0, 3.0)
    assert max(pauses) == API_RETRY_CAP_SECONDS
    assert list(pauses) == sorted(pauses)  # never shorter after a longer one
    assert (
        API_RETRY_WINDOW_SECONDS <= sum(pauses) < API_RETRY_WINDOW_SECONDS + API_RETRY_CAP_SECONDS
    )


def test_watched_resources_are_every_resource_a_handler_is_registered_for() -> None:
    registry = build_registry()
    selectors = (
        registry._indexing.get_all_selectors()
        | registry._watching.get_all_selectors()
        | registry._spawning.get_all_selectors()
        | registry._changing.get_all_selectors()
    )
    registered = {(s.group or "", s.version, s.any_name) for s in selectors}
    assert registered == set(WATCHED_RESOURCES)
    assert len(WATCHED_RESOURCES) == len(set(WATCHED_RESOURCES))


@pytest.mark.parametrize(
    ("config", "watches"),
    [
        (OperatorConfig(namespaces=("a",)), len(WATCHED_RESOURCES)),
        (OperatorConfig(namespaces=("a", "b", "c")), 3 * len(WATCHED_RESOURCES)),
        (OperatorConfig(all_namespaces=True), len(WATCHED_RESOURCES)),
    ],
)
def test_kopf_connections_leave_every_watch_one_and_bound_the_rest(
    config: OperatorConfig, watches: int
) -> None:
    assert kopf_connections(config) == watches + KOPF_REQUEST_CONNECTIONS


def test_every_handler_is_registered_with_a_stable_id() -> None:
    registry = build_registry()
    ids = {
        "changing": {h.id for h in registry._changing.get_all_handlers()},
        "spawning": {h.id for h in registry._spawning.get_all_handlers()},
        "indexing": {h.id for h in registry._indexing.get_all_handlers()},
        "watching": {h.id for h in registry._watching.get_all_handlers()},
        "activities": {h.id for h in registry._activities.get_all_handlers()},
    }
    assert ids == {
        "changing": {"lora_unload"},
        "spawning": {"resync", "autoscale", "kv_transfer", "lora_sync"},
        "indexing": {
            "worker_pods",
            "pod_workers",
            "worker_metadata",
            "dynamo_workers",
            "lora_adapters",
            *(f"children_{k.plural}" for k in CHILD_KINDS),
        },
        "watching": {
            *(f"{k.plural}_changed" for k in CHILD_KINDS),
            "pod_changed",
            "metadata_changed",
            "lora_changed",
            "lora_pod_changed",
            "lora_worker_changed",
            "dynamoworker_changed",
        },
        "activities": {"login", "start", "stop", "watching"},
    }
    # Only a deletion handler: with no create, update or resume handler, nothing reads kopf's
    # diff base, which is why the settings store none (NoDiffBase).
    handlers = registry._changing.get_all_handlers()
    assert [(h.reason, h.initial) for h in handlers] == [("delete", None)]


@pytest.mark.parametrize(
    ("tasks", "namespaces", "problem"),
    [
        (["watcher for dynamoworkers.v1alpha1.dynamo.dev@a"], ("a",), None),
        (["watcher for dynamoworkers.v1alpha1.dynamo.dev@a"], ("a", "b"), "namespace(s) b"),
        (["watcher for pods.v1@a", "poster of events"], ("a",), "namespace(s) a"),
        (["watcher for dynamoworkers.v1alpha1.dynamo.dev@None"], (), None),
        ([], (), "namespace(s) None"),
    ],
)
def test_watcher_problem(
    tasks: list[str], namespaces: tuple[str, ...], problem: str | None
) -> None:
    found = watcher_problem(tasks, namespaces)
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert problem in found


def test_a_watcher_that_stopped_is_a_liveness_problem() -> None:
    seen = frozenset(
        {
            "watcher for dynamoworkers.v1alpha1.dynamo.dev@a",
            "watcher for dynamoworkermetadatas.v1alpha1.nvidia.com@a",
        }
    )
    assert watcher_problem(sorted(seen), ("a",), seen) is None
    # kopf ended the metadata watcher on a 404 (its CRD replaced) and never restarts it.
    found = watcher_problem(["watcher for dynamoworkers.v1alpha1.dynamo.dev@a"], ("a",), seen)
    assert found is not None
    assert "dynamoworkermetadatas.v1alpha1.nvidia.com@a" in found


def test_context_is_shared_across_kopfs_copies() -> None:
    ctx = OperatorContext(OperatorConfig(namespaces=("a",)))
    assert copy.copy(ctx) is ctx
    with pytest.raises(RuntimeError, match="not started"):
        _ = ctx.services


@pytest.mark.parametrize(
    "argv",
    [["run"], ["run", "-n", "a", "--all-namespaces"], ["run", "-n", "a", "-v", "-q"]],
)
def test_run_refuses_an_unclear_scope_or_verbosity(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "not allowed with" in err or "is required" in err


def test_config_refuses_a_bad_resync_period() -> None:
    with pytest.raises(ValueError, match="--resync-seconds"):
        OperatorConfig(namespaces=("a",), resync_seconds=0)
    with pytest.raises(ValueError, match="--namespace"):
        OperatorConfig()


def test_the_indices_view_reads_every_index_by_namespace() -> None:
    pod = PodSummary(name="llm-a", uid="u", ip="198.18.0.9", ready=False, terminating=False)
    record = DynamoWorkerMetadata.model_validate(
        {
            "apiVersion": "nvidia.com/v1alpha1",
            "kind": "DynamoWorkerMetadata",
            "metadata": {"name": "llm-a", "namespace": "ns"},
            "spec": {"data": {}},
        }
    )
    worker = WorkerInfo("llm")
    service = CachedChild.of(
        {"kind": "Service", "metadata": {"name": "llm", "uid": "s", "managedFields": [{}]}}
    )
    # kopf's indices are mappings of keys to collections of values; so are these.
    view = Indices.of(
        {
            "worker_pods": {("ns", "llm"): [pod]},
            "pod_workers": {("ns", "llm-a"): ["llm"]},
            "worker_metadata": {("ns", "llm-a"): [record]},
            "dynamo_workers": {"ns": [worker]},
            "lora_adapters": {},
            **{child_index_id(k): {} for k in CHILD_KINDS},
            child_index_id(kinds.SERVICE): {("ns", "llm"): [service]},
            "logger": logging.getLogger("ignored"),
        }
    )
    assert view.pods("ns", "llm") == [pod]
    assert view.pods("other", "llm") == []
    assert view.metadata("ns", [pod]) == {"llm-a": record}
    assert view.worker_of_pod("ns", "llm-a") == "llm"
    assert view.worker_of_pod("ns", "llm-b") is None
    assert view.workers("ns") == [worker]
    assert view.adapters("ns") == []
    namespace = view.adapter_view("ns")
    assert (namespace.workers, namespace.adapters) == ([worker], [])
    # An adapter loads onto a pod whose containers are ready, whatever its readiness gate.
    assert [(p.name, p.worker) for p in namespace.pods_of("llm")] == [("llm-a", "llm")]
    # Children: by kind and name, without what no reconcile reads (managedFields).
    children = view.children(frozenset({"Service"}))
    assert children.watches(kinds.SERVICE)
    assert not children.watches(kinds.POD_MONITOR)
    found = children.get(("Service", "ns", "llm"))
    assert found is not None
    assert found.body() == {"kind": "Service", "metadata": {"name": "llm", "uid": "s"}}
    assert children.get(("Service", "ns", "other")) is None


async def test_one_resync_loop_runs_on_triggers_requests_and_the_period() -> None:
    memo = OperatorContext(OperatorConfig(namespaces=("ns",), resync_seconds=0.6))
    setter: FlagSetter[Any] = FlagSetter()
    stopped = setter.async_waiter
    key = ("LoRAAdapter", "ns", "sql")
    passes: list[bool] = []
    asked = asyncio.Event()

    async def reconcile(full: bool) -> float | None:
        passes.append(full)
        asked.set()
        # The first pass asks to run again soon (a backoff ending); later ones do not.
        return 0.1 if len(passes) == 1 else None

    body = kopf.Body({"metadata": {"name": "sql", "finalizers": [FINALIZER]}})
    loop = asyncio.create_task(resync_loop(memo, key, body, stopped, reconcile))
    try:
        for want in (2, 3, 4):
            while len(passes) < want:
                asked.clear()
                if want == 3:
                    memo.wake(*key)  # a watch event: a pass between resyncs
                await asyncio.wait_for(asked.wait(), timeout=5)
        # At start, when asked (a full pass: no trigger), on the trigger, at the resync.
        assert passes[:4] == [True, True, False, True]
        assert memo.metrics.managed_objects.labels(kind="LoRAAdapter")._value.get() == 1
    finally:
        setter.set()
        await asyncio.wait_for(loop, timeout=5)
    assert memo.metrics.managed_objects.labels(kind="LoRAAdapter")._value.get() == 0


class RecordedPasses:
    """A reconcile that records each pass (whether full) and says when one ran."""

    def __init__(self) -> None:
        self.passes: list[bool] = []
        self.ran = asyncio.Event()

    async def __call__(self, full: bool) -> float | None:
        self.passes.append(full)
        self.ran.set()
        return None


class WatchedSlot(asyncio.Semaphore):
    """One reconcile slot that says when a loop asks for it."""

    def __init__(self) -> None:
        super().__init__(1)
        self.asked = asyncio.Event()

    async def acquire(self) -> Literal[True]:
        self.asked.set()
        return await super().acquire()


async def test_a_resync_loop_stopped_while_it_waits_for_a_slot_starts_no_pass() -> None:
    # kopf stops the daemon when a deletion begins and runs the deletion handler: a pass the
    # loop started after that would run beside it (and write children it just removed).
    memo = OperatorContext(OperatorConfig(namespaces=("ns",)))
    slot = memo.reconcile_slots = WatchedSlot()
    setter: FlagSetter[Any] = FlagSetter()
    key = ("DynamoWorker", "ns", "llm")
    body = kopf.Body({"metadata": {"name": "llm", "finalizers": [FINALIZER]}})
    reconcile = RecordedPasses()
    loop = asyncio.create_task(resync_loop(memo, key, body, setter.async_waiter, reconcile))
    try:
        await asyncio.wait_for(reconcile.ran.wait(), timeout=5)
        async with slot:  # another object's pass holds the only slot
            slot.asked.clear()
            memo.wake(*key)
            await asyncio.wait_for(slot.asked.wait(), timeout=5)
            setter.set()
        await asyncio.wait_for(loop, timeout=5)
    finally:
        setter.set()
        await asyncio.wait_for(loop, timeout=5)
    assert reconcile.passes == [True]


async def test_the_resync_loop_reconciles_nothing_before_kopfs_finalizer_is_on() -> None:
    # kopf spawns the daemon in the pass that asks for its finalizer; under API errors that
    # PATCH is retried for minutes, and a reconcile meanwhile would serve with no finalizer.
    memo = OperatorContext(OperatorConfig(namespaces=("ns",)))
    setter: FlagSetter[Any] = FlagSetter()
    key = ("DynamoWorker", "ns", "llm")
    raw: Any = {"metadata": {"name": "llm"}}
    body = kopf.Body(raw)  # kopf's live body: it follows `raw`
    reconcile = RecordedPasses()
    loop = asyncio.create_task(resync_loop(memo, key, body, setter.async_waiter, reconcile))
    try:
        memo.wake(*key)  # events do not bypass the wait
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(reconcile.ran.wait()), timeout=1.5)
        assert reconcile.passes == []
        raw["metadata"]["finalizers"] = [FINALIZER]  # kopf's PATCH went through at last
        await asyncio.wait_for(reconcile.ran.wait(), timeout=5)
        assert reconcile.passes == [True]
    finally:
        setter.set()
        await asyncio.wait_for(loop, timeout=5)
