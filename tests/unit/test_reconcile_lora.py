"""The LoRAAdapter planner (`reconcile.lora`): per-pod actions, states and conditions.

A small in-memory fleet plays the workers' side of `/v1/loras` as `LoRAAdapterHost` behaves
(idempotent loads, hot swaps that keep the old version on failure, a capacity bound), so the
tests can run the planner round after round, complete requests in any order, and check the
invariants: status never says Loaded for a pod that does not list the adapter, a rollout
swaps one pod at a time and never leaves the name unserved, and nothing is retried before
its backoff ends, restarts of the operator included. The same fleet behind the reconciler
checks that a refused status write loses no Event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest

from dynamo_operator.api.common import LabelSelector
from dynamo_operator.api.loraadapter import AdapterState, LoRAAdapter, LoRAAdapterStatus
from dynamo_operator.k8s import kinds
from dynamo_operator.k8s.client import ApiError, Cluster
from dynamo_operator.metrics import OperatorMetrics
from dynamo_operator.pods.adapters import (
    WORKER_UNREACHABLE,
    Listing,
    LoraClient,
    OpResult,
    reason_for,
)
from dynamo_operator.reconcile.errors import TransientError
from dynamo_operator.reconcile.events import Regarding, event_manifest
from dynamo_operator.reconcile.loraadapter import plan as planner
from dynamo_operator.reconcile.loraadapter.model import (
    Action,
    AdapterObservation,
    Backoff,
    InFlight,
    Pod,
    PodTrack,
)
from dynamo_operator.reconcile.loraadapter.reasons import WORKER_MESSAGE_MAX, scrub
from dynamo_operator.reconcile.loraadapter.reconciler import LoraReconciler, NamespaceView
from dynamo_operator.reconcile.loraadapter.status import SOURCE_PINNED
from dynamo_operator.reconcile.loraadapter.targeting import (
    AdapterRef,
    WorkerInfo,
    missing_worker_message,
    name_conflict,
    target_workers,
)

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
V1 = "s3://adapters/sql/v1"
V2 = "s3://adapters/sql/v2"
SHA = "a" * 64
BACKOFF = Backoff(base_seconds=2.0, max_seconds=60.0)


def make_adapter(
    uri: str = V1,
    *,
    sha256: str | None = None,
    placement: dict[str, Any] | None = None,
    worker: str = "llm",
    name: str = "sql",
    status: dict[str, Any] | None = None,
    generation: int = 1,
    created: str = "2026-01-01T00:00:00Z",
) -> LoRAAdapter:
    source: dict[str, Any] = {"uri": uri}
    if sha256 is not None:
        source["sha256"] = sha256
    spec: dict[str, Any] = {"workerRef": {"name": worker}, "source": source}
    if placement is not None:
        spec["placement"] = placement
    return LoRAAdapter.model_validate(
        {
            "metadata": {
                "name": name,
                "namespace": "ns",
                "uid": f"uid-{name}",
                "generation": generation,
                "creationTimestamp": created,
            },
            "spec": spec,
            "status": status,
        }
    )


@dataclass
class FakePod:
    """One worker's adapter table, as `LoRAAdapterHost` keeps it. `lists_sources`: its
    `GET /v1/loras` says where each adapter came from (ours do; upstream's do not)."""

    serving: dict[str, str] = field(default_factory=dict)  # name -> uri
    capacity: int = 4
    reachable: bool = True
    fail_uris: set[str] = field(default_factory=set)
    lists_sources: bool = False


@dataclass
class Fleet:
    """Pods of one worker plus what the operator remembers, advanced round by round."""

    adapter: LoRAAdapter
    pods: dict[str, FakePod]
    now: datetime = T0
    tracks: dict[str, PodTrack] = field(default_factory=dict)
    in_flight: dict[str, Action] = field(default_factory=dict)
    workers: tuple[WorkerInfo, ...] = (WorkerInfo("llm"),)
    history: list[planner.Plan] = field(default_factory=list)

    def listings(self) -> dict[str, Listing]:
        out = {}
        for name, pod in self.pods.items():
            if pod.reachable:
                loras = {n: 1000 + i for i, n in enumerate(sorted(pod.serving))}
                sources = {n: (uri, None) for n, uri in pod.serving.items()}
                out[name] = Listing(loras=loras, sources=sources if pod.lists_sources else {})
            else:
                out[name] = Listing(reason=WORKER_UNREACHABLE, message="connection refused")
        return out

    def observed(self) -> AdapterObservation:
        return AdapterObservation(
            now=self.now,
            workers=self.workers,
            pods=[Pod(n, "llm", f"198.18.1.{i + 2}", True) for i, n in enumerate(self.pods)],
            listings=self.listings(),
            in_flight={
                p: InFlight(a.op, a.uri, a.sha256, a.swap) for p, a in self.in_flight.items()
            },
            tracks=dict(self.tracks),
        )

    def round(self) -> planner.Plan:
        plan = planner.plan(self.adapter, self.observed(), BACKOFF)
        self.tracks = plan.tracks
        for action in plan.actions:
            assert action.pod not in self.in_flight, "a second request to a busy pod"
            self.in_flight[action.pod] = action
        self.history.append(plan)
        check_invariants(plan, self)
        return plan

    def finish(self, pod: str) -> OpResult:
        """Complete the request in flight to `pod` as the worker would."""
        action = self.in_flight.pop(pod)
        worker = self.pods[pod]
        name = self.adapter.adapter_name or ""
        if action.op == "unload":
            result = OpResult(ok=worker.serving.pop(name, None) is not None, reason="NotLoaded")
        elif not worker.reachable:
            result = OpResult(ok=False, reason=WORKER_UNREACHABLE, message="refused")
        elif action.uri in worker.fail_uris:
            result = OpResult(ok=False, reason="DigestMismatch", message="digest mismatch")
        elif name not in worker.serving and len(worker.serving) >= worker.capacity:
            result = OpResult(
                ok=False,
                reason="CapacityExceeded",
                message=f"LoRA capacity exceeded: at most {worker.capacity} adapter(s)",
            )
        else:
            worker.serving[name] = action.uri or ""
            result = OpResult(ok=True, lora_id=1000)
        track = planner.record_result(self.tracks.get(pod), action, result, self.now, BACKOFF)
        if track is None:
            self.tracks.pop(pod, None)
        else:
            self.tracks[pod] = track
        return result

    def finish_all(self) -> None:
        for pod in sorted(self.in_flight):
            self.finish(pod)

    def settle(self, rounds: int = 20) -> planner.Plan:
        """Rounds with every request completing at once, until nothing is left to do."""
        plan = self.round()
        for _ in range(rounds):
            if not self.in_flight:
                return plan
            self.finish_all()
            plan = self.round()
        raise AssertionError("did not settle")

    def status(self) -> LoRAAdapterStatus:
        return LoRAAdapterStatus.model_validate(self.history[-1].status)


def check_invariants(plan: planner.Plan, fleet: Fleet) -> None:
    status = LoRAAdapterStatus.model_validate(plan.status)  # valid against the API model
    name = fleet.adapter.adapter_name or ""
    for entry in status.pods:
        if entry.state == AdapterState.LOADED:
            pod = fleet.pods[entry.pod]
            assert pod.reachable, f"{entry.pod} claimed Loaded while unreachable"
            assert name in pod.serving, f"{entry.pod} claimed Loaded without listing it"
            if entry.uri is not None:
                assert pod.serving[name] == entry.uri
    swaps = [a for a in fleet.in_flight.values() if a.swap]
    assert len(swaps) <= 1, "two hot swaps at once"
    assert status.loaded == f"{status.loaded_replicas}/{status.target_replicas}"


def condition(status: LoRAAdapterStatus, type_: str) -> tuple[str, str, str]:
    for c in status.conditions:
        if c.type == type_:
            return c.status, c.reason, c.message
    raise AssertionError(f"no {type_} condition")


def pod_entry(status: LoRAAdapterStatus, pod: str) -> Any:
    return next(p for p in status.pods if p.pod == pod)


def fleet_of(n: int, adapter: LoRAAdapter | None = None, **kwargs: Any) -> Fleet:
    pods = {f"llm-{chr(ord('a') + i)}": FakePod(**kwargs) for i in range(n)}
    return Fleet(adapter=adapter or make_adapter(), pods=pods)


# --- loading and verifying ------------------------------------------------------------------


def test_every_ready_pod_loads_and_is_loaded_only_once_listed() -> None:
    fleet = fleet_of(2)
    plan = fleet.round()
    assert sorted((a.op, a.pod, a.uri) for a in plan.actions) == [
        ("load", "llm-a", V1),
        ("load", "llm-b", V1),
    ]
    status = fleet.status()
    assert [p.state for p in status.pods] == [AdapterState.LOADING] * 2
    assert condition(status, "Ready")[:2] == ("False", "Loading")
    assert condition(status, "Progressing")[:2] == ("True", "Loading")
    assert status.loaded == "0/2"

    fleet.finish_all()
    # The POSTs succeeded, but status waits for GET /v1/loras to list the adapter.
    plan = fleet.round()
    status = fleet.status()
    assert plan.newly_loaded == ("llm-a", "llm-b")
    assert [(p.state, p.lora_id, p.uri, p.attempts) for p in status.pods] == [
        (AdapterState.LOADED, 1000, V1, 0)
    ] * 2
    assert condition(status, "Ready") == ("True", "AllLoaded", f"2 of 2 pods serve 'sql' from {V1}")
    assert condition(status, "Progressing")[:2] == ("False", "Complete")
    assert condition(status, "Degraded")[:2] == ("False", "AsExpected")
    assert (status.loaded, status.adapter_name, status.observed_generation) == ("2/2", "sql", 1)
    # Converged: nothing to do, and the same status again.
    again = fleet.round()
    assert again.actions == ()
    assert again.status == plan.status
    assert again.newly_loaded == ()


def test_a_load_the_worker_accepted_but_does_not_list_is_a_failure() -> None:
    fleet = fleet_of(1)
    fleet.round()
    fleet.finish_all()
    fleet.pods["llm-a"].serving.clear()  # accepted, yet gone from the list
    fleet.round()
    entry = pod_entry(fleet.status(), "llm-a")
    assert (entry.state, entry.reason, entry.attempts) == (AdapterState.FAILED, "NotListed", 1)
    assert fleet.round().actions == ()  # waits for the backoff


def test_a_pod_that_lost_the_adapter_is_reloaded_at_once() -> None:
    fleet = fleet_of(2)
    fleet.settle()
    fleet.pods["llm-b"].serving.clear()  # the worker restarted
    plan = fleet.round()
    assert plan.lost == ("llm-b",)
    assert [(a.op, a.pod, a.swap) for a in plan.actions] == [("load", "llm-b", False)]
    assert condition(fleet.status(), "Ready")[:2] == ("False", "Loading")
    fleet.finish_all()
    assert fleet.round().newly_loaded == ("llm-b",)
    assert fleet.status().loaded == "2/2"


def test_an_unreachable_pod_is_never_reported_loaded() -> None:
    fleet = fleet_of(2)
    fleet.settle()
    fleet.pods["llm-a"].reachable = False
    fleet.round()
    status = fleet.status()
    entry = pod_entry(status, "llm-a")
    assert (entry.state, entry.reason) == (AdapterState.PENDING, "WorkerUnreachable")
    assert "connection refused" in (entry.message or "")
    assert condition(status, "Ready")[:2] == ("False", "WorkerUnreachable")
    assert status.loaded == "1/2"
    # Back, still serving it: Loaded again without a request.
    fleet.pods["llm-a"].reachable = True
    plan = fleet.round()
    assert plan.actions == ()
    assert fleet.status().loaded == "2/2"


def test_pods_that_are_not_ready_are_not_targets() -> None:
    adapter = make_adapter()
    observed = AdapterObservation(
        now=T0,
        workers=[WorkerInfo("llm")],
        pods=[
            Pod("llm-a", "llm", "198.18.1.2", True),
            Pod("llm-b", "llm", "198.18.1.3", False),
            Pod("llm-c", "llm", None, True),
            Pod("llm-d", "llm", "198.18.1.5", True, terminating=True),
        ],
        listings={"llm-a": Listing(loras={})},
    )
    plan = planner.plan(adapter, observed, BACKOFF)
    assert [a.pod for a in plan.actions] == ["llm-a"]
    assert plan.targets == ("llm-a",)


# --- backoff ----------------------------------------------------------------------------------


def test_backoff_doubles_up_to_the_cap() -> None:
    assert [BACKOFF.delay(n) for n in range(0, 8)] == [0, 2, 4, 8, 16, 32, 60, 60]
    assert Backoff().delay(100) == 300


def test_failed_loads_are_retried_only_after_the_backoff() -> None:
    fleet = fleet_of(1)
    fleet.pods["llm-a"].fail_uris.add(V1)
    attempt_times = []
    for second in range(0, 40):
        fleet.now = T0 + timedelta(seconds=second)
        plan = fleet.round()
        if plan.actions:
            attempt_times.append(second)
            fleet.finish_all()
    # Attempts at 0, then 2, 4 and 8 seconds after each failure.
    assert attempt_times == [0, 2, 6, 14, 30]
    entry = pod_entry(fleet.status(), "llm-a")
    assert (entry.state, entry.reason, entry.attempts) == (
        AdapterState.FAILED,
        "DigestMismatch",
        5,
    )
    assert entry.last_transition_time == T0 + timedelta(seconds=30)
    assert "Attempt 5; the next one in 32s" in (entry.message or "")
    assert "spec.source.sha256" in (entry.message or "")
    status = fleet.status()
    assert condition(status, "Degraded")[:2] == ("True", "DigestMismatch")
    assert condition(status, "Ready")[:2] == ("False", "DigestMismatch")
    assert condition(status, "Progressing")[:2] == ("True", "RetryingWithBackoff")
    assert fleet.history[-1].next_retry_at == T0 + timedelta(seconds=62)


def test_backoff_survives_an_operator_restart() -> None:
    fleet = fleet_of(1)
    fleet.pods["llm-a"].fail_uris.add(V1)
    fleet.round()
    fleet.finish_all()
    fleet.round()
    stored = fleet.history[-1].status
    # A new operator: no memory, only the stored status.
    restarted = make_adapter(status=stored)
    tracks = {
        p.pod: PodTrack.from_status(p, T0) for p in LoRAAdapterStatus.model_validate(stored).pods
    }
    fleet.adapter, fleet.tracks = restarted, tracks
    fleet.now = T0 + timedelta(seconds=1)
    assert fleet.round().actions == ()
    fleet.now = T0 + timedelta(seconds=2)
    assert [a.pod for a in fleet.round().actions] == ["llm-a"]


def test_a_new_source_resets_attempts() -> None:
    fleet = fleet_of(1)
    fleet.pods["llm-a"].fail_uris.add(V1)
    fleet.round()
    fleet.finish_all()
    fleet.adapter = make_adapter(V2, generation=2)
    plan = fleet.round()
    assert [(a.pod, a.uri) for a in plan.actions] == [("llm-a", V2)]
    fleet.finish_all()
    fleet.round()
    entry = pod_entry(fleet.status(), "llm-a")
    assert (entry.state, entry.uri, entry.attempts) == (AdapterState.LOADED, V2, 0)


# --- rollout ----------------------------------------------------------------------------------


def test_a_new_source_rolls_one_pod_at_a_time_and_never_unserves_the_name() -> None:
    fleet = fleet_of(4)
    fleet.settle()
    fleet.adapter = make_adapter(V2, generation=2)
    order = []
    for _ in range(12):
        plan = fleet.round()
        swaps = [a for a in plan.actions if a.swap]
        assert len(swaps) <= 1
        order += [a.pod for a in swaps]
        # Every pod serves the name throughout (hot swaps replace in place).
        assert all("sql" in p.serving for p in fleet.pods.values())
        status = fleet.status()
        waiting = [p for p in status.pods if p.reason == "OutdatedSource"]
        assert all(p.state == AdapterState.LOADED and p.uri == V1 for p in waiting)
        if not fleet.in_flight:
            break
        fleet.finish_all()
    assert order == ["llm-a", "llm-b", "llm-c", "llm-d"]
    assert {p.serving["sql"] for p in fleet.pods.values()} == {V2}
    status = fleet.status()
    assert status.loaded == "4/4"
    assert condition(status, "Ready")[:2] == ("True", "AllLoaded")


def test_the_next_swap_waits_for_the_previous_to_be_verified() -> None:
    fleet = fleet_of(2)
    fleet.settle()
    fleet.adapter = make_adapter(V2, generation=2)
    plan = fleet.round()
    assert [a.pod for a in plan.actions] == ["llm-a"]
    status = fleet.status()
    assert condition(status, "Progressing")[:2] == ("True", "RollingOut")
    assert condition(status, "Ready")[:2] == ("False", "RollingOut")
    assert fleet.round().actions == ()  # llm-a is still being swapped
    fleet.finish("llm-a")
    # llm-a answered, but is not verified yet in this round: llm-b's turn comes with it.
    plan = fleet.round()
    assert [a.pod for a in plan.actions] == ["llm-b"]
    assert plan.newly_loaded == ("llm-a",)


def test_a_failed_swap_stops_the_rollout_and_keeps_the_old_version() -> None:
    fleet = fleet_of(3)
    fleet.settle()
    for pod in fleet.pods.values():
        pod.fail_uris.add(V2)
    fleet.adapter = make_adapter(V2, generation=2)
    fleet.round()
    fleet.finish_all()
    for second in range(0, 10):
        fleet.now = T0 + timedelta(seconds=second)
        plan = fleet.round()
        assert [a.pod for a in plan.actions] in ([], ["llm-a"])  # only llm-a's retries
        fleet.finish_all()
    status = fleet.status()
    entry = pod_entry(status, "llm-a")
    assert (entry.state, entry.reason) == (AdapterState.FAILED, "DigestMismatch")
    assert "still serves the previous version" in (entry.message or "")
    assert {p.serving["sql"] for p in fleet.pods.values()} == {V1}
    assert condition(status, "Degraded")[:2] == ("True", "DigestMismatch")
    # Fixing the source resumes the rollout.
    fleet.adapter = make_adapter("s3://adapters/sql/v3", generation=3)
    for pod in fleet.pods.values():
        pod.fail_uris.clear()
    fleet.settle()
    assert {p.serving["sql"] for p in fleet.pods.values()} == {"s3://adapters/sql/v3"}


def test_new_pods_get_the_current_source_during_a_rollout() -> None:
    fleet = fleet_of(2)
    fleet.settle()
    fleet.adapter = make_adapter(V2, generation=2)
    fleet.pods["llm-z"] = FakePod()  # a scale-out during the rollout
    plan = fleet.round()
    assert sorted((a.pod, a.swap) for a in plan.actions) == [("llm-a", True), ("llm-z", False)]


def test_an_unknown_version_is_verified_by_an_idempotent_load() -> None:
    # The operator lost its memory and status: a pod serves the name, source unknown.
    fleet = fleet_of(1)
    fleet.pods["llm-a"].serving["sql"] = V1
    plan = fleet.round()
    assert [(a.pod, a.swap) for a in plan.actions] == [("llm-a", True)]
    entry = pod_entry(fleet.status(), "llm-a")
    assert entry.state == AdapterState.LOADING
    fleet.finish_all()
    fleet.round()
    assert fleet.status().loaded == "1/1"


def test_a_pod_that_lists_the_current_source_is_adopted_without_a_load() -> None:
    # The operator lost its memory and status; the pod says it serves spec.source.
    fleet = fleet_of(1, lists_sources=True)
    fleet.pods["llm-a"].serving["sql"] = V1
    plan = fleet.round()
    assert plan.actions == ()
    assert plan.newly_loaded == ("llm-a",)
    entry = pod_entry(fleet.status(), "llm-a")
    assert (entry.state, entry.uri, entry.reason) == (AdapterState.LOADED, V1, None)
    assert fleet.status().loaded == "1/1"


def test_a_load_finished_after_its_operator_died_is_adopted() -> None:
    # Status says Loading (the operator recorded the request, then was killed while the
    # worker finished it): its successor adopts the load instead of repeating it.
    fleet = fleet_of(2, lists_sources=True)
    fleet.round()
    for pod, action in list(fleet.in_flight.items()):
        fleet.pods[pod].serving["sql"] = action.uri or ""
    fleet.in_flight.clear()  # a new operator: nothing in flight, the recorded tracks
    assert [t.state for t in fleet.tracks.values()] == [AdapterState.LOADING] * 2
    plan = fleet.round()
    assert plan.actions == ()
    assert fleet.status().loaded == "2/2"


def test_a_listed_older_source_is_still_rolled() -> None:
    fleet = fleet_of(2, adapter=make_adapter(V2), lists_sources=True)
    for pod in fleet.pods.values():
        pod.serving["sql"] = V1
    plan = fleet.round()
    assert [(a.op, a.uri, a.swap) for a in plan.actions] == [("load", V2, True)]
    fleet.settle()
    assert {pod.serving["sql"] for pod in fleet.pods.values()} == {V2}
    assert fleet.status().loaded == "2/2"


# --- placement --------------------------------------------------------------------------------


def test_count_placement_prefers_the_pods_with_fewest_adapters() -> None:
    fleet = fleet_of(4, make_adapter(placement={"policy": "Count", "replicas": 2}))
    fleet.pods["llm-a"].serving = {"x": "s3://b/x", "y": "s3://b/y"}
    fleet.pods["llm-b"].serving = {"x": "s3://b/x"}
    fleet.pods["llm-d"].serving = {"y": "s3://b/y"}
    plan = fleet.round()
    assert sorted(a.pod for a in plan.actions) == ["llm-b", "llm-c"]
    fleet.settle()
    status = fleet.status()
    assert (status.loaded, [p.pod for p in status.pods]) == ("2/2", ["llm-b", "llm-c"])


def test_count_placement_moves_on_after_capacity_exceeded() -> None:
    fleet = fleet_of(3, make_adapter(placement={"policy": "Count", "replicas": 1}))
    fleet.pods["llm-a"].capacity = 0
    fleet.pods["llm-b"].serving = {"x": "s3://b/x"}
    fleet.pods["llm-c"].serving = {"x": "s3://b/x", "y": "s3://b/y"}
    plan = fleet.round()
    assert [a.pod for a in plan.actions] == ["llm-a"]
    fleet.finish_all()
    plan = fleet.round()
    assert [a.pod for a in plan.actions] == ["llm-b"]  # the next fewest
    status = fleet.status()
    entry = pod_entry(status, "llm-a")  # shown while the target is not met
    assert (entry.state, entry.reason) == (AdapterState.FAILED, "CapacityExceeded")
    fleet.finish_all()
    fleet.round()
    status = fleet.status()
    assert [p.pod for p in status.pods] == ["llm-b"]
    assert status.loaded == "1/1"
    assert condition(status, "Degraded")[:2] == ("False", "AsExpected")


def test_count_placement_unloads_surplus_pods() -> None:
    fleet = fleet_of(3, make_adapter(placement={"policy": "Count", "replicas": 3}))
    fleet.settle()
    fleet.adapter = make_adapter(placement={"policy": "Count", "replicas": 1}, generation=2)
    plan = fleet.round()
    assert sorted((a.op, a.pod) for a in plan.actions) == [
        ("unload", "llm-b"),
        ("unload", "llm-c"),
    ]
    status = fleet.status()
    assert [(p.pod, p.state) for p in status.pods] == [
        ("llm-a", AdapterState.LOADED),
        ("llm-b", AdapterState.UNLOADING),
        ("llm-c", AdapterState.UNLOADING),
    ]
    assert condition(status, "Ready")[:2] == ("True", "AllLoaded")
    assert condition(status, "Progressing")[:2] == ("True", "Unloading")
    fleet.finish_all()
    fleet.round()
    status = fleet.status()
    assert [p.pod for p in status.pods] == ["llm-a"]
    assert [name for name, p in fleet.pods.items() if "sql" in p.serving] == ["llm-a"]


def test_capacity_exceeded_on_all_replicas_leaves_the_others_alone() -> None:
    fleet = fleet_of(2)
    fleet.pods["llm-b"].capacity = 1
    fleet.pods["llm-b"].serving = {"other": "s3://b/other"}
    fleet.round()
    fleet.finish_all()
    fleet.round()
    status = fleet.status()
    assert pod_entry(status, "llm-a").state == AdapterState.LOADED
    entry = pod_entry(status, "llm-b")
    assert (entry.state, entry.reason) == (AdapterState.FAILED, "CapacityExceeded")
    assert "spec.lora.maxLoras on DynamoWorker llm" in (entry.message or "")
    degraded = condition(status, "Degraded")
    assert degraded[:2] == ("True", "CapacityExceeded")
    assert degraded[2].startswith("pod llm-b: load failed: LoRA capacity exceeded")
    assert status.loaded == "1/2"
    assert fleet.pods["llm-b"].serving == {"other": "s3://b/other"}


# --- whole-object conditions ----------------------------------------------------------------


def plan_once(adapter: LoRAAdapter, **observed: Any) -> LoRAAdapterStatus:
    plan = planner.plan(adapter, AdapterObservation(now=T0, **observed), BACKOFF)
    return LoRAAdapterStatus.model_validate(plan.status)


def test_a_missing_worker_is_reported_with_the_field_to_fix() -> None:
    adapter = make_adapter(worker="nope")
    status = plan_once(adapter, missing_worker=missing_worker_message(adapter))
    ready = condition(status, "Ready")
    assert ready[:2] == ("False", "WorkerNotFound")
    assert (
        ready[2] == "DynamoWorker nope does not exist in ns; create it or fix spec.workerRef.name"
    )
    assert condition(status, "Degraded")[:2] == ("True", "WorkerNotFound")
    assert status.loaded == "0/0"


def test_no_ready_pods() -> None:
    status = plan_once(make_adapter(), workers=[WorkerInfo("llm")])
    assert condition(status, "Ready")[:2] == ("False", "NoReadyPods")
    assert condition(status, "Degraded")[:2] == ("False", "AsExpected")


def test_a_worker_without_lora_fails_its_pods_with_the_fix() -> None:
    status = plan_once(
        make_adapter(),
        workers=[WorkerInfo("llm", lora_enabled=False)],
        pods=[Pod("llm-a", "llm", "198.18.1.2", True)],
        listings={"llm-a": Listing(loras={})},
    )
    entry = pod_entry(status, "llm-a")
    assert (entry.state, entry.reason) == (AdapterState.FAILED, "LoRADisabled")
    assert "set spec.lora.enabled: true on DynamoWorker llm" in (entry.message or "")
    assert condition(status, "Degraded")[:2] == ("True", "LoRADisabled")


def test_name_conflicts_keep_the_older_adapter() -> None:
    older = AdapterRef.of(make_adapter(name="first", created="2026-01-01T00:00:00Z"))
    newer = AdapterRef.of(make_adapter(name="second", created="2026-01-02T00:00:00Z"))
    other_worker = AdapterRef.of(make_adapter(name="third", worker="other"))
    workers = [WorkerInfo("llm"), WorkerInfo("other")]
    # Both serve the name `sql`? Only when adapterName matches: metadata.name differs here.
    assert name_conflict(newer, [older], workers) is None
    same = AdapterRef("second", "uid-2", "2026-01-02T00:00:00Z", older.adapter_name, "llm", None)
    assert name_conflict(same, [older, other_worker], workers) == "first"
    assert name_conflict(older, [same], workers) is None
    status = plan_once(
        make_adapter(name="first"),
        workers=workers,
        pods=[Pod("llm-a", "llm", "198.18.1.2", True)],
        listings={"llm-a": Listing(loras={"first": 3})},
        conflict="zeroth",
    )
    assert condition(status, "Ready")[:2] == ("False", "NameConflict")
    assert "spec.adapterName" in condition(status, "Ready")[2]


def test_selectors_pick_workers_by_labels() -> None:
    selector = LabelSelector.model_validate(
        {
            "matchLabels": {"team": "a"},
            "matchExpressions": [
                {"key": "tier", "operator": "In", "values": ["gold", "silver"]},
                {"key": "frozen", "operator": "DoesNotExist"},
            ],
        }
    )
    ref = AdapterRef("x", "u", "", "x", None, selector)
    workers = [
        WorkerInfo("w1", {"team": "a", "tier": "gold"}),
        WorkerInfo("w2", {"team": "a", "tier": "bronze"}),
        WorkerInfo("w3", {"team": "a", "tier": "silver", "frozen": "y"}),
        WorkerInfo("w4", {"team": "b", "tier": "gold"}),
    ]
    assert [w.name for w in target_workers(ref, workers)] == ["w1"]


def test_pods_of_a_worker_no_longer_targeted_are_unloaded() -> None:
    adapter = make_adapter(worker="new")
    old_track = PodTrack("old-a", "old", AdapterState.LOADED, T0, V1, None, 5, verified=True)
    plan = planner.plan(
        adapter,
        AdapterObservation(
            now=T0,
            workers=[WorkerInfo("new")],
            pods=[Pod("old-a", "old", "198.18.1.2", True), Pod("new-a", "new", "198.18.1.3", True)],
            listings={"old-a": Listing(loras={"sql": 5}), "new-a": Listing(loras={})},
            tracks={"old-a": old_track},
        ),
        BACKOFF,
    )
    assert sorted((a.op, a.pod) for a in plan.actions) == [("load", "new-a"), ("unload", "old-a")]


@pytest.mark.parametrize(
    ("uri", "sha256", "expected"),
    [
        ("hf://org/repo", None, ("False", "UnpinnedRevision")),
        ("hf://org/repo@abc123", None, ("True", "Pinned")),
        ("hf://org/repo", SHA, ("True", "Pinned")),
        (V1, None, None),
    ],
)
def test_hf_sources_without_a_pin_are_warned_about(
    uri: str, sha256: str | None, expected: tuple[str, str] | None
) -> None:
    status = plan_once(make_adapter(uri, sha256=sha256), workers=[WorkerInfo("llm")])
    found = [c for c in status.conditions if c.type == SOURCE_PINNED]
    if expected is None:
        assert found == []
    else:
        assert (found[0].status, found[0].reason) == expected
        if expected[0] == "False":
            assert "hf://org/repo@<commit>" in found[0].message


def test_transition_times_move_only_when_status_changes() -> None:
    fleet = fleet_of(1)
    fleet.settle()
    first = fleet.status()
    fleet.adapter = make_adapter(status=fleet.history[-1].status)
    fleet.now = T0 + timedelta(minutes=5)
    fleet.round()
    assert fleet.status().conditions == first.conditions
    assert fleet.status().pods == first.pods


# --- worker answers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("http_status", "worker_reason", "message", "reason"),
    [
        (500, "digest mismatch", "Failed to download LoRA: ...", "DigestMismatch"),
        (500, "not found", "", "SourceNotFound"),
        (500, "auth", "", "AuthFailed"),
        (500, "capacity", "", "CapacityExceeded"),
        (
            500,
            None,
            "LoRA capacity exceeded: at most 2 adapter(s) may be loaded",
            "CapacityExceeded",
        ),
        (500, "bad uri", "", "InvalidSource"),
        (500, "engine", "", "EngineError"),
        (404, None, "Not Found", "LoRADisabled"),
        (500, "something new", "", "LoadFailed"),
    ],
)
def test_worker_reasons_map_to_camel_case(
    http_status: int, worker_reason: str | None, message: str, reason: str
) -> None:
    assert reason_for(http_status, worker_reason, message) == reason


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("fetching s3://AKIA:sekrit@bucket/x failed", "fetching s3://***@bucket/x failed"),
        ("env AWS_SECRET_ACCESS_KEY=canary-123 leaked", "env AWS_SECRET_ACCESS_KEY=*** leaked"),
        ("token hf_abcdefghijklmnop refused", "token hf_*** refused"),
        ("many\n  lines\tjoined", "many lines joined"),
    ],
)
def test_worker_messages_are_scrubbed(raw: str, clean: str) -> None:
    assert scrub(raw) == clean


def test_long_worker_messages_are_cut() -> None:
    assert len(scrub("x" * 5000)) == WORKER_MESSAGE_MAX


def test_event_manifest_regards_the_adapter() -> None:
    event = event_manifest(
        Regarding(kinds.LORA_ADAPTER, "ns", "sql", "u1"),
        reason="Loaded",
        note="n" * 5000,
        event_type="Normal",
        action="Load",
        now=T0,
        reporting_instance="op-1",
    )
    assert event["regarding"] == {
        "apiVersion": "dynamo.dev/v1alpha1",
        "kind": "LoRAAdapter",
        "name": "sql",
        "namespace": "ns",
        "uid": "u1",
    }
    assert event["eventTime"] == "2026-01-01T12:00:00.000000Z"
    assert len(event["note"]) == 1024


def test_a_freed_slot_ends_the_capacity_backoff() -> None:
    fleet = fleet_of(1, capacity=1)
    fleet.workers = (WorkerInfo("llm", max_loras=1),)
    fleet.pods["llm-a"].serving = {"other": "s3://b/other"}
    fleet.round()
    fleet.finish_all()
    assert fleet.round().actions == ()  # full: waits for the backoff
    fleet.pods["llm-a"].serving.clear()  # the other adapter was deleted
    plan = fleet.round()
    assert [(a.op, a.pod) for a in plan.actions] == [("load", "llm-a")]
    fleet.finish_all()
    fleet.round()
    assert fleet.status().loaded == "1/1"


# --- the reconciler -------------------------------------------------------------------------


class RefusingApi:
    """The API calls a LoRAAdapter reconcile makes: status patches, the next `refusals` of
    which the server refuses, and Events, kept in order."""

    def __init__(self) -> None:
        self.refusals = 0
        self.patches: list[dict[str, Any]] = []
        self.events: list[Mapping[str, Any]] = []

    async def patch_status(
        self, kind: kinds.Kind, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        if self.refusals:
            self.refusals -= 1
            raise ApiError(503, "ServiceUnavailable", "etcd leader changed", "patch status")
        self.patches.append(dict(patch))
        return {"metadata": {"resourceVersion": str(len(self.patches))}}

    async def create_event(self, namespace: str, event: Mapping[str, Any]) -> None:
        self.events.append(event)

    def reasons(self) -> list[str]:
        return [str(e["reason"]) for e in self.events]


class FleetClient:
    """`/v1/loras` of a Fleet's pods, by IP: loads always succeed."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.names = {p.ip: p.name for p in fleet.observed().pods}

    async def list(self, ip: str) -> Listing:
        return self.fleet.listings()[self.names[ip]]

    async def load(self, ip: str, name: str, uri: str, sha256: str | None) -> OpResult:
        self.fleet.pods[self.names[ip]].serving[name] = uri
        return OpResult(ok=True, lora_id=1000)


async def test_a_refused_status_write_loses_no_loaded_event() -> None:
    fleet = fleet_of(1)
    api = RefusingApi()
    metrics = OperatorMetrics()
    reconciler = LoraReconciler(
        cast(Cluster, api), cast(LoraClient, FleetClient(fleet)), metrics=metrics
    )
    view = NamespaceView(workers=fleet.workers, pods_of=lambda worker: fleet.observed().pods)
    body = fleet.adapter.to_dict()

    await reconciler.reconcile(body, view)  # starts the load
    await reconciler.wait_idle()
    api.refusals = 1
    with pytest.raises(TransientError):
        await reconciler.reconcile(body, view)  # sees the pod serve it; the write fails
    assert api.reasons() == ["Loaded"]
    outcome = await reconciler.reconcile(body, view)  # kopf's retry
    assert outcome.status_written
    assert LoRAAdapterStatus.model_validate(outcome.status).loaded == "1/1"
    assert api.reasons() == ["Loaded"]  # announced once, not again by the retry
    load_seconds = "dynamo_operator_lora_load_duration_seconds_count"
    assert metrics.registry.get_sample_value(load_seconds) == 1.0


class UnreachableClient(FleetClient):
    """A Fleet whose pods never answer an unload; it counts the tries."""

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(fleet)
        self.unloads: list[str] = []

    async def unload(self, ip: str, name: str, timeout_seconds: float | None = None) -> OpResult:
        self.unloads.append(ip)
        return OpResult(ok=False, reason="RequestTimeout", message="no answer")


async def test_a_deletion_handled_again_does_not_ask_the_pods_again() -> None:
    """kopf may run the deletion handler twice (seen on the test bed): the second run must not
    wait another bound on a pod that did not answer the first."""
    fleet = fleet_of(2)
    api = RefusingApi()
    client = UnreachableClient(fleet)
    reconciler = LoraReconciler(cast(Cluster, api), cast(LoraClient, client))
    view = NamespaceView(workers=fleet.workers, pods_of=lambda worker: fleet.observed().pods)
    body = fleet.adapter.to_dict()

    first = await reconciler.finalize(body, view)
    assert len(first.failed) == 2
    assert len(client.unloads) == 2
    again = await reconciler.finalize(body, view)
    assert again.skipped
    assert not again.failed
    assert len(client.unloads) == 2
    assert api.reasons() == ["UnloadIncomplete"]


class HeldListingClient(FleetClient):
    """A Fleet whose pods answer `GET /v1/loras` only once `answer` is set, and unload."""

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(fleet)
        self.listing = asyncio.Event()
        self.answer = asyncio.Event()

    async def list(self, ip: str) -> Listing:
        self.listing.set()
        await self.answer.wait()
        return await super().list(ip)

    async def unload(self, ip: str, name: str, timeout_seconds: float | None = None) -> OpResult:
        served = self.fleet.pods[self.names[ip]].serving.pop(name, None)
        return OpResult(ok=served is not None, reason="NotLoaded")


def serving(fleet: Fleet) -> dict[str, list[str]]:
    return {name: sorted(pod.serving) for name, pod in fleet.pods.items()}


async def test_a_pass_that_began_before_the_deletion_loads_nothing_after_it() -> None:
    """kopf lets a pass its daemon began run beside the deletion handler (seen on the test bed:
    a deleted adapter still served): what that pass planned must not land after the unload."""
    fleet = fleet_of(2)
    client = HeldListingClient(fleet)
    reconciler = LoraReconciler(cast(Cluster, RefusingApi()), cast(LoraClient, client))
    view = NamespaceView(workers=fleet.workers, pods_of=lambda worker: fleet.observed().pods)
    body = fleet.adapter.to_dict()

    began = asyncio.create_task(reconciler.reconcile(body, view))
    await client.listing.wait()
    client.answer.set()  # answered, but the pass resumes only after the deletion began
    await reconciler.finalize(body, view)
    outcome = await began
    await reconciler.wait_idle()
    assert outcome.actions == ()
    assert serving(fleet) == {name: [] for name in fleet.pods}


async def test_a_pass_on_an_adapter_being_deleted_loads_nothing() -> None:
    """The daemon's last pass may come after the deletion handler unloaded and forgot the
    adapter; its body then carries the deletion timestamp."""
    fleet = fleet_of(2)
    client = HeldListingClient(fleet)
    client.answer.set()
    reconciler = LoraReconciler(cast(Cluster, RefusingApi()), cast(LoraClient, client))
    view = NamespaceView(workers=fleet.workers, pods_of=lambda worker: fleet.observed().pods)
    body = fleet.adapter.to_dict()
    await reconciler.finalize(body, view)

    deleting = {
        **body,
        "metadata": {**body["metadata"], "deletionTimestamp": "2026-12-07T20:00:00Z"},
    }
    outcome = await reconciler.reconcile(deleting, view)
    await reconciler.wait_idle()
    assert outcome.actions == ()
    assert serving(fleet) == {name: [] for name in fleet.pods}
