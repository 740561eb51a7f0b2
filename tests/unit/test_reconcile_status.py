"""Status computation: a table of observations and the conditions they yield, per-pod summaries
read from DynamoWorkerMetadata, pod problems read from Pod manifests, and the stability that
keeps a converged worker's status from being rewritten."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from dynamo_operator.api import DynamoWorker
from dynamo_operator.api.dynamoworker import DynamoWorkerStatus
from dynamo_operator.api.metadata import DynamoWorkerMetadata
from dynamo_operator.k8s import kinds
from dynamo_operator.reconcile.dynamoworker.pod_summary import PodProblem, PodSummary
from dynamo_operator.reconcile.dynamoworker.status import (
    DEPLOYMENT_LAG_HOLD_SECONDS,
    WorkerObservation,
    compute_status,
    status_hold_seconds,
)
from dynamo_operator.reconcile.dynamoworker.transitions import note, transitions
from dynamo_operator.reconcile.events import Regarding, event_manifest
from support.api_cases import dynamo_worker

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def worker(
    replicas: int = 2, generation: int = 3, status: dict[str, Any] | None = None
) -> DynamoWorker:
    body = dynamo_worker("llm", {"replicas": replicas})
    body["metadata"] |= {"namespace": "ns", "uid": "u-1", "generation": generation}
    if status is not None:
        body["status"] = status
    return DynamoWorker.model_validate(body)


def deployment(
    *,
    replicas: int = 2,
    ready: int = 2,
    updated: int = 2,
    generation: int = 5,
    observed: int = 5,
    conditions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {"name": "llm", "generation": generation},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "conditions": conditions or [],
        },
    }


def pod(
    name: str, ready: bool = True, problem: PodProblem | None = None, detail: str = ""
) -> PodSummary:
    return PodSummary(
        name=name,
        uid=f"uid-{name}",
        ip="198.18.16.5",
        ready=ready,
        terminating=False,
        problem=problem,
        problem_detail=detail,
    )


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def message(status: dict[str, Any], type_: str) -> str:
    return str(next(c["message"] for c in status["conditions"] if c["type"] == type_))


CASES: list[tuple[str, int, WorkerObservation, dict[str, tuple[str, str]], dict[str, str]]] = [
    (
        "all-ready",
        2,
        WorkerObservation(now=T0, deployment=deployment(), pods=[pod("a"), pod("b")]),
        {
            "Ready": ("True", "AllReplicasReady"),
            "Progressing": ("False", "RolloutComplete"),
            "Degraded": ("False", "AsExpected"),
        },
        {"Ready": "2 of 2 pods are ready"},
    ),
    (
        "not-created-yet",
        2,
        WorkerObservation(now=T0),
        {
            "Ready": ("False", "DeploymentMissing"),
            "Progressing": ("True", "Creating"),
            "Degraded": ("False", "AsExpected"),
        },
        {},
    ),
    (
        "controller-not-caught-up",
        2,
        WorkerObservation(now=T0, deployment=deployment(generation=6, observed=5)),
        {"Ready": ("True", "AllReplicasReady"), "Progressing": ("True", "RollingOut")},
        {"Progressing": "waiting for the Deployment controller"},
    ),
    (
        "rolling",
        2,
        WorkerObservation(now=T0, deployment=deployment(replicas=3, ready=2, updated=1)),
        {"Ready": ("True", "AllReplicasReady"), "Progressing": ("True", "RollingOut")},
        {"Progressing": "1 of 2 pods run generation 3 of the spec (3 pods in all)"},
    ),
    (
        "starting",
        2,
        WorkerObservation(
            now=T0, deployment=deployment(ready=1), pods=[pod("a"), pod("b", ready=False)]
        ),
        {"Ready": ("False", "WaitingForPods"), "Progressing": ("True", "ScalingUp")},
        {"Ready": "1 of 2 pods are ready; pods load the model"},
    ),
    (
        "scaling-down",
        1,
        WorkerObservation(now=T0, deployment=deployment(replicas=2, ready=2, updated=2)),
        {"Ready": ("True", "AllReplicasReady"), "Progressing": ("True", "ScalingDown")},
        {},
    ),
    (
        "scaled-to-zero",
        0,
        WorkerObservation(now=T0, deployment=deployment(replicas=0, ready=0, updated=0)),
        {"Ready": ("True", "ScaledToZero"), "Progressing": ("False", "RolloutComplete")},
        {"Ready": "spec.replicas is 0"},
    ),
    (
        "unschedulable",
        2,
        WorkerObservation(
            now=T0,
            deployment=deployment(ready=0),
            pods=[
                pod("b", False, PodProblem.UNSCHEDULABLE, "0/4 nodes: Insufficient nvidia.com/gpu"),
                pod("a", False, PodProblem.UNSCHEDULABLE, "0/4 nodes: Insufficient nvidia.com/gpu"),
            ],
        ),
        {"Ready": ("False", "WaitingForPods"), "Degraded": ("True", "PodsUnschedulable")},
        {
            "Degraded": "pods a, b cannot be scheduled (0/4 nodes: Insufficient nvidia.com/gpu); "
            "lower spec.resources",
            "Ready": "see the Degraded condition",
        },
    ),
    (
        "missing-secret-beats-crashloop",
        1,
        WorkerObservation(
            now=T0,
            deployment=deployment(replicas=2, ready=0),
            pods=[
                pod("x", False, PodProblem.CRASH_LOOP, "back-off 5m0s"),
                pod("y", False, PodProblem.CONFIG, 'secret "s3-creds" not found'),
            ],
        ),
        {"Degraded": ("True", "PodConfigError")},
        {"Degraded": 'pod y cannot start the container (secret "s3-creds" not found)'},
    ),
    (
        "image-pull",
        1,
        WorkerObservation(
            now=T0,
            deployment=deployment(replicas=1, ready=0, updated=1),
            pods=[pod("x", False, PodProblem.IMAGE_PULL, "ErrImagePull")],
        ),
        {"Degraded": ("True", "ImagePullFailed")},
        {"Degraded": "check spec.image"},
    ),
    (
        "oom",
        1,
        WorkerObservation(
            now=T0,
            deployment=deployment(replicas=1, ready=0, updated=1),
            pods=[pod("x", False, PodProblem.OOM_KILLED, "the container ran out of memory")],
        ),
        {"Degraded": ("True", "OOMKilled")},
        {"Degraded": "raise spec.resources.memory"},
    ),
    (
        "stalled-rollout",
        2,
        WorkerObservation(
            now=T0,
            deployment=deployment(
                replicas=3,
                updated=1,
                conditions=[
                    {
                        "type": "Progressing",
                        "status": "False",
                        "reason": "ProgressDeadlineExceeded",
                        "message": 'ReplicaSet "llm-7f" has timed out progressing.',
                    }
                ],
            ),
        ),
        {
            "Progressing": ("False", "ProgressDeadlineExceeded"),
            "Degraded": ("True", "ProgressDeadlineExceeded"),
        },
        {"Degraded": "has timed out progressing"},
    ),
    (
        "replica-failure",
        2,
        WorkerObservation(
            now=T0,
            deployment=deployment(
                ready=0,
                conditions=[
                    {
                        "type": "ReplicaFailure",
                        "status": "True",
                        "reason": "FailedCreate",
                        "message": 'pods "llm-1" is forbidden: exceeded quota',
                    }
                ],
            ),
        ),
        {"Degraded": ("True", "ReplicaFailure")},
        {"Degraded": "exceeded quota"},
    ),
    (
        "child-refused",
        2,
        WorkerObservation(now=T0, child_errors=["Deployment llm: admission webhook denied"]),
        {"Ready": ("False", "ApplyFailed"), "Degraded": ("True", "ApplyFailed")},
        {"Degraded": "Deployment llm: admission webhook denied"},
    ),
    (
        "taints-failed",
        1,
        WorkerObservation(
            now=T0,
            deployment=deployment(replicas=1, ready=1, updated=1),
            taint_failures={"x": "HTTP 500: reserved prefix"},
        ),
        {"Ready": ("True", "AllReplicasReady"), "Degraded": ("True", "TaintUpdateFailed")},
        {"Degraded": "spec.modelTaints could not be applied to x: HTTP 500"},
    ),
    (
        "pod-monitor-missing",
        1,
        WorkerObservation(
            now=T0,
            deployment=deployment(replicas=1, ready=1, updated=1),
            pod_monitor_unavailable=True,
        ),
        {"Degraded": ("True", "PodMonitorUnavailable")},
        {"Degraded": "set podMonitor to Auto"},
    ),
    (
        "invalid-spec",
        1,
        WorkerObservation(now=T0, spec_error="spec.image is unset; set spec.image"),
        {
            "Ready": ("False", "InvalidSpec"),
            "Progressing": ("False", "InvalidSpec"),
            "Degraded": ("True", "InvalidSpec"),
        },
        {"Degraded": "set spec.image"},
    ),
]


@pytest.mark.parametrize(
    ("case", "replicas", "observed", "expected", "messages"), CASES, ids=[c[0] for c in CASES]
)
def test_conditions_for_each_observation(
    case: str,
    replicas: int,
    observed: WorkerObservation,
    expected: dict[str, tuple[str, str]],
    messages: dict[str, str],
) -> None:
    status = compute_status(worker(replicas), observed)
    got = conditions(status)
    assert [c["type"] for c in status["conditions"]] == ["Ready", "Progressing", "Degraded"]
    for type_, want in expected.items():
        assert got[type_] == want, (type_, message(status, type_))
    for type_, fragment in messages.items():
        assert fragment in message(status, type_)
    assert all(c["observedGeneration"] == 3 for c in status["conditions"])
    DynamoWorkerStatus.model_validate(status)  # within the CRD's bounds


def test_counts_selector_and_generation() -> None:
    status = compute_status(
        worker(2), WorkerObservation(now=T0, deployment=deployment(replicas=3, ready=2, updated=1))
    )
    assert status["observedGeneration"] == 3
    assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == (3, 2, 1)
    assert status["selector"] == "dynamo.dev/worker=llm"


def test_transition_time_moves_only_when_status_changes() -> None:
    first = compute_status(worker(), WorkerObservation(now=T0, deployment=deployment(ready=1)))
    later = T0 + timedelta(minutes=5)
    # Same statuses, other counts in the message: the transition time stays.
    second = compute_status(
        worker(status=first),
        WorkerObservation(now=later, deployment=deployment(ready=1, replicas=3)),
    )
    ready = {c["type"]: c for c in second["conditions"]}["Ready"]
    assert ready["lastTransitionTime"] == "2026-01-01T12:00:00Z"
    third = compute_status(
        worker(status=second), WorkerObservation(now=later, deployment=deployment())
    )
    ready = {c["type"]: c for c in third["conditions"]}["Ready"]
    assert (ready["status"], ready["lastTransitionTime"]) == ("True", "2026-01-01T12:05:00Z")


def test_converged_status_recomputes_equal() -> None:
    observed = WorkerObservation(now=T0, deployment=deployment(), pods=[pod("b"), pod("a")])
    status = compute_status(worker(), observed)
    again = compute_status(
        worker(status=copy.deepcopy(status)),
        WorkerObservation(
            now=T0 + timedelta(hours=1), deployment=deployment(), pods=[pod("a"), pod("b")]
        ),
    )
    assert again == status
    # As the status is stored: read back, it is what a write would send.
    assert DynamoWorkerStatus.model_validate(status).to_dict() == status


def metadata_record(pod_name: str) -> DynamoWorkerMetadata:
    card: dict[str, Any] = {
        "type": "Model",
        "namespace": "ns-llm",
        "component": "worker",
        "endpoint": "generate",
        "instance_id": 7,
        "card_json": {
            "display_name": "Qwen/Qwen3-0.6B",
            "runtime_config": {
                "data_parallel_start_rank": 4,
                "data_parallel_size": 2,
                "taints": ["gpu=h100", "dynamo.topology/zone=a"],
                "runtime_data": {
                    "token_budget": {"combined_limit": 4096, "reject_prompt_overflow": True}
                },
            },
        },
    }
    adapter = copy.deepcopy(card)
    adapter["model_suffix"] = "sql"
    adapter["card_json"]["lora"] = {"name": "sql-expert"}
    return DynamoWorkerMetadata.model_validate(
        {
            "metadata": {"name": pod_name},
            "spec": {"data": {"model_cards": {"k/base": card, "k/sql": adapter}}},
        }
    )


def test_per_pod_summaries_come_from_worker_metadata() -> None:
    observed = WorkerObservation(
        now=T0,
        deployment=deployment(),
        pods=[
            pod("b", ready=False),
            pod("a"),
            PodSummary("gone", "u", None, False, terminating=True),
        ],
        metadata={"a": metadata_record("a")},
    )
    pods = compute_status(worker(), observed)["pods"]
    assert pods == [
        {
            "name": "a",
            "ready": True,
            "tokenBudget": {
                "combinedLimit": 4096,
                "rejectPromptOverflow": True,
                "rejectTotalOverflow": False,
            },
            "taints": ["gpu=h100"],
            "loadedAdapters": ["sql-expert"],
            "dpRanks": [4, 5],
        },
        {"name": "b", "ready": False, "taints": [], "loadedAdapters": [], "dpRanks": []},
    ]


def pod_manifest(**status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "llm-1", "uid": "u1"},
        "status": {"podIP": "198.18.16.9", **status},
    }


@pytest.mark.parametrize(
    ("status", "ready", "problem", "detail"),
    [
        ({"conditions": [{"type": "Ready", "status": "True"}]}, True, None, ""),
        (
            {
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/4 nodes are available",
                    }
                ]
            },
            False,
            PodProblem.UNSCHEDULABLE,
            "0/4 nodes are available",
        ),
        (
            {
                "containerStatuses": [
                    {
                        "restartCount": 0,
                        "state": {
                            "waiting": {
                                "reason": "CreateContainerConfigError",
                                "message": 'secret "hf" not found',
                            }
                        },
                    }
                ]
            },
            False,
            PodProblem.CONFIG,
            'secret "hf" not found',
        ),
        (
            {
                "containerStatuses": [
                    {
                        "restartCount": 4,
                        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                        "lastState": {"terminated": {"reason": "OOMKilled"}},
                    }
                ]
            },
            False,
            PodProblem.OOM_KILLED,
            "the container ran out of memory",
        ),
        (
            {"containerStatuses": [{"state": {"waiting": {"reason": "ImagePullBackOff"}}}]},
            False,
            PodProblem.IMAGE_PULL,
            "ImagePullBackOff",
        ),
        (
            {"containerStatuses": [{"state": {"waiting": {"reason": "ContainerCreating"}}}]},
            False,
            None,
            "",
        ),
    ],
)
def test_pod_summary_reads_problems(
    status: dict[str, Any], ready: bool, problem: PodProblem | None, detail: str
) -> None:
    summary = PodSummary.from_pod(pod_manifest(**status))
    assert (summary.ready, summary.problem, summary.problem_detail) == (ready, problem, detail)
    assert summary.ip == "198.18.16.9"


def test_events_for_significant_transitions_only() -> None:
    first = DynamoWorkerStatus.model_validate(
        compute_status(worker(), WorkerObservation(now=T0, deployment=deployment(ready=0)))
    )
    # Created and not ready yet: only the rollout is news.
    news = transitions([], first.conditions)
    assert [(c.type, c.status, t) for c, t in news] == [("Progressing", "True", "Normal")]
    ready = DynamoWorkerStatus.model_validate(
        compute_status(worker(), WorkerObservation(now=T0, deployment=deployment()))
    )
    news = transitions(first.conditions, ready.conditions)
    assert [(c.type, c.reason, t) for c, t in news] == [
        ("Ready", "AllReplicasReady", "Normal"),
        ("Progressing", "RolloutComplete", "Normal"),
    ]
    assert transitions(ready.conditions, ready.conditions) == []
    degraded = DynamoWorkerStatus.model_validate(
        compute_status(
            worker(),
            WorkerObservation(now=T0, deployment=deployment(), taint_failures={"a": "refused"}),
        )
    )
    condition, kind = transitions(ready.conditions, degraded.conditions)[0]
    event = event_manifest(
        Regarding(kinds.DYNAMO_WORKER, "ns", "llm", "u-1"),
        reason=condition.reason,
        note=note(condition),
        event_type=kind,
        action="Reconcile",
        now=T0,
        reporting_instance="op-0",
    )
    assert event["type"] == "Warning"
    assert event["reason"] == "TaintUpdateFailed"
    assert event["regarding"] == {
        "apiVersion": "dynamo.dev/v1alpha1",
        "kind": "DynamoWorker",
        "name": "llm",
        "namespace": "ns",
        "uid": "u-1",
    }
    assert event["eventTime"] == "2026-01-01T12:00:00.000000Z"
    assert event["note"].startswith("Degraded=True: spec.modelTaints")


def with_frontend(replicas: int) -> DynamoWorker:
    body = dynamo_worker("llm", {"replicas": 2, "frontend": {"replicas": replicas}})
    body["metadata"] |= {"namespace": "ns", "uid": "u-1", "generation": 3}
    return DynamoWorker.model_validate(body)


@pytest.mark.parametrize(
    ("frontend_replicas", "frontend", "ready", "fragment", "counts"),
    [
        (1, None, ("False", "WaitingForFrontend"), "Deployment does not exist", (0, 0)),
        (2, deployment(replicas=2, ready=1), ("False", "WaitingForFrontend"), "1 of 2", (2, 1)),
        (1, deployment(replicas=1, ready=1), ("True", "AllReplicasReady"), "2 of 2 pods", (1, 1)),
        (0, deployment(replicas=0, ready=0), ("True", "AllReplicasReady"), "2 of 2 pods", (0, 0)),
    ],
)
def test_ready_waits_for_the_frontend(
    frontend_replicas: int,
    frontend: dict[str, Any] | None,
    ready: tuple[str, str],
    fragment: str,
    counts: tuple[int, int],
) -> None:
    observed = WorkerObservation(now=T0, deployment=deployment(), frontend_deployment=frontend)
    status = compute_status(with_frontend(frontend_replicas), observed)
    assert conditions(status)["Ready"] == ready
    assert fragment in message(status, "Ready")
    assert (status["frontend"]["replicas"], status["frontend"]["readyReplicas"]) == counts
    assert status["frontend"]["url"] == "http://llm-frontend.ns.svc:8000"
    DynamoWorkerStatus.model_validate(status)


def test_no_frontend_no_frontend_status() -> None:
    status = compute_status(worker(), WorkerObservation(now=T0, deployment=deployment()))
    assert "frontend" not in status


def test_a_failing_frontend_degrades() -> None:
    stalled = deployment(
        ready=0,
        conditions=[
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": 'ReplicaSet "llm-frontend-1" has timed out progressing.',
            }
        ],
    )
    stalled["metadata"]["name"] = "llm-frontend"
    observed = WorkerObservation(now=T0, deployment=deployment(), frontend_deployment=stalled)
    status = compute_status(with_frontend(1), observed)
    assert conditions(status)["Degraded"] == ("True", "FrontendFailing")
    assert "llm-frontend" in message(status, "Degraded")
    assert "spec.frontend.image" in message(status, "Degraded")
    assert conditions(status)["Ready"] == ("False", "WaitingForFrontend")


def test_a_status_waits_for_a_lagging_deployment_to_count_a_ready_pod() -> None:
    hold = DEPLOYMENT_LAG_HOLD_SECONDS
    waiting = compute_status(
        worker(1), WorkerObservation(now=T0, deployment=deployment(replicas=0, ready=0, updated=0))
    )
    # The pod is ready; the Deployment controller has not counted it yet.
    lagging = compute_status(
        worker(1, status=waiting),
        WorkerObservation(
            now=T0, deployment=deployment(replicas=1, ready=0, updated=1), pods=[pod("a")]
        ),
    )
    caught_up = compute_status(
        worker(1, status=lagging),
        WorkerObservation(
            now=T0, deployment=deployment(replicas=1, ready=1, updated=1), pods=[pod("a")]
        ),
    )
    assert [p["ready"] for p in lagging["pods"]] == [True]
    assert lagging["readyReplicas"] == 0
    assert status_hold_seconds(waiting, lagging, 0) == hold
    assert status_hold_seconds(waiting, lagging, 2.0) == hold - 2.0
    # Written at once: once held for the whole hold, once the Deployment agrees (here with
    # Ready's transition), or when a condition changes status.
    assert status_hold_seconds(waiting, lagging, hold) == 0
    assert status_hold_seconds(waiting, lagging, hold + 1) == 0
    assert conditions(caught_up)["Ready"][0] == "True"
    assert status_hold_seconds(lagging, caught_up, 2.0) == 0
    degraded = compute_status(
        worker(1, status=waiting),
        WorkerObservation(
            now=T0,
            deployment=deployment(replicas=1, ready=0, updated=1),
            pods=[pod("a")],
            child_errors=["Role r: refused"],
        ),
    )
    assert conditions(degraded)["Degraded"][0] == "True"
    assert status_hold_seconds(waiting, degraded, 2.0) == 0
    # Counts alone, with no pod ahead of the Deployment, are written at once.
    starting = compute_status(
        worker(1, status=waiting),
        WorkerObservation(
            now=T0, deployment=deployment(replicas=1, ready=0, updated=1), pods=[pod("a", False)]
        ),
    )
    assert status_hold_seconds(waiting, starting, 2.0) == 0
    next_generation = compute_status(
        worker(1, generation=4, status=lagging),
        WorkerObservation(
            now=T0, deployment=deployment(replicas=1, ready=0, updated=1), pods=[pod("a")]
        ),
    )
    assert status_hold_seconds(lagging, next_generation, 2.0) == 0
