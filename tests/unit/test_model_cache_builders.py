"""spec.model.cache on the operator's side (pure): the claim, the fill Job, the worker pods'
mount, the fill's state from the live Job and pods, and how status reports it."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from dynamo.runtime import model_cache as worker_cache
from dynamo_operator.api.dynamoworker import DynamoWorkerStatus
from dynamo_operator.reconcile.dynamoworker import interface as wi
from dynamo_operator.reconcile.dynamoworker.builders import desired_children, desired_deployment
from dynamo_operator.reconcile.dynamoworker.labels import WORKER_LABEL
from dynamo_operator.reconcile.dynamoworker.model_cache import (
    RETRY_MAX_SECONDS,
    CachePhase,
    cache_key,
    cache_state,
    desired_claim,
    desired_fill_job,
    desired_prune_job,
    failure_of,
    parse_progress,
    retry_delay_seconds,
    rolled_out,
    stale_key,
)
from dynamo_operator.reconcile.dynamoworker.settings import ReconcileSettings
from dynamo_operator.reconcile.dynamoworker.status import WorkerObservation, compute_status
from support.api_cases import dynamo_worker, stored

pytestmark = pytest.mark.unit

SETTINGS = ReconcileSettings(worker_image="registry.example.com/dynamo-worker:0.1")
SOURCE = "s3://models/qwen"
NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def cached(cache: dict[str, Any] | None = None, name: str = "llm", **spec: Any) -> Any:
    model = {"source": SOURCE, "cache": cache or {"size": "20Gi"}}
    credentials = {"s3": {"secretName": "s3-creds", "endpoint": "http://s3.storage:9000"}}
    return stored(dynamo_worker(name, {"model": model, "credentials": credentials, **spec}))


def job(conditions: list[dict[str, Any]] | None = None, attempt: int = 1) -> dict[str, Any]:
    manifest = desired_fill_job(cached(), SETTINGS, attempt)
    manifest["metadata"]["uid"] = "job-uid"
    manifest["status"] = {"conditions": conditions or []}
    return manifest


def pod(phase: str, *, message: str | None = None, created: str = "2026-12-03T11:00:00Z") -> Any:
    status: dict[str, Any] = {"phase": phase}
    if message is not None:
        terminated = {"exitCode": 2, "message": message}
        status["containerStatuses"] = [{"name": "cache", "state": {"terminated": terminated}}]
    return {"metadata": {"name": f"fill-{created}", "creationTimestamp": created}, "status": status}


def test_the_cache_key_is_the_workers() -> None:
    """Both sides name the source's directory alike, or pods would never find their weights."""
    for source in (SOURCE, "hf://Qwen/Qwen3-0.6B@main", "s3://b/p/"):
        assert cache_key(source) == worker_cache.cache_key(source)


def test_an_owned_claim_follows_the_spec_and_an_existing_one_is_left_alone() -> None:
    claim = desired_claim(
        cached({"size": "100Gi", "storageClassName": "fast", "accessMode": "ReadWriteMany"})
    )
    assert claim is not None
    assert claim["metadata"]["name"] == "llm-model-cache"
    assert claim["metadata"]["ownerReferences"][0]["kind"] == "DynamoWorker"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "100Gi"}},
        "storageClassName": "fast",
    }
    assert desired_claim(cached({"claimName": "weights"})) is None


def test_the_fill_job_runs_the_worker_image_restricted_with_secret_references() -> None:
    manifest = desired_fill_job(cached(), SETTINGS, 3)
    assert manifest["metadata"]["name"] == f"llm-fill-{cache_key(SOURCE)[:6]}"
    assert manifest["metadata"]["annotations"]["dynamo.dev/fill-attempt"] == "3"
    spec = manifest["spec"]
    rule = spec["podFailurePolicy"]["rules"][0]
    assert rule["action"] == "FailJob"
    assert rule["onExitCodes"]["values"] == [2]
    assert spec["podReplacementPolicy"] == "Failed"
    pod_spec = spec["template"]["spec"]
    assert WORKER_LABEL not in spec["template"]["metadata"]["labels"]
    assert pod_spec["automountServiceAccountToken"] is False
    assert pod_spec["restartPolicy"] == "Never"
    assert pod_spec["securityContext"]["runAsNonRoot"] is True
    (container,) = pod_spec["containers"]
    assert container["image"] == SETTINGS.worker_image
    assert container["command"] == [
        "dynamo-model-cache",
        "fill",
        "--source",
        SOURCE,
        "--cache",
        wi.MODEL_CACHE_PATH,
    ]
    assert container["name"] == "cache"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    env = {e["name"]: e for e in container["env"]}
    assert "value" not in env["AWS_SECRET_ACCESS_KEY"]
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "s3-creds"
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "llm-model-cache"}


def test_job_names_are_label_values_for_the_longest_worker_name() -> None:
    worker = cached(name="w" * 50)
    for job_ in (desired_fill_job(worker, SETTINGS, 1), desired_prune_job(worker, SETTINGS)):
        assert len(job_["metadata"]["name"]) <= 63


def test_an_earlier_sources_directory_is_pruned_from_an_owned_claim_only() -> None:
    def reported(dw: Any, key: str, stale: str | None = None) -> Any:
        dw.status = DynamoWorkerStatus.model_validate(
            {"modelCache": {"key": key, "claimName": "c", "staleKey": stale}}
        )
        return dw

    current = cache_key(SOURCE)
    assert stale_key(cached()) is None  # nothing reported yet
    assert stale_key(reported(cached(), "0123456789abcdef")) == "0123456789abcdef"
    assert stale_key(reported(cached(), current, "0123456789abcdef")) == "0123456789abcdef"
    assert stale_key(reported(cached(), current)) is None
    assert stale_key(reported(cached(), "0123456789abcdef", current)) == "0123456789abcdef"
    # Back to the source whose directory was to go: it stays.
    assert stale_key(reported(cached(), current, current)) is None
    assert stale_key(reported(cached({"claimName": "mine"}), "0123456789abcdef")) is None
    prune = desired_prune_job(cached(), SETTINGS)
    (container,) = prune["spec"]["template"]["spec"]["containers"]
    assert container["command"] == [
        "dynamo-model-cache",
        "prune",
        "--keep",
        current,
        "--cache",
        wi.MODEL_CACHE_PATH,
    ]
    assert "AWS_SECRET_ACCESS_KEY" not in str(container["env"])


def test_rolled_out_means_every_pod_runs_the_current_spec() -> None:
    dw = cached(replicas=2)
    meta = {"generation": 3}
    done = {"observedGeneration": 3, "replicas": 2, "updatedReplicas": 2}
    assert rolled_out(dw, {"metadata": meta, "status": done})
    assert not rolled_out(dw, {"metadata": meta, "status": {**done, "replicas": 3}})
    assert not rolled_out(dw, {"metadata": meta, "status": {**done, "updatedReplicas": 1}})
    assert not rolled_out(dw, {"metadata": meta, "status": {**done, "observedGeneration": 2}})
    assert not rolled_out(dw, None)


def test_worker_pods_mount_the_cache_read_only_and_never_download() -> None:
    deployment = desired_deployment(cached({"claimName": "weights"}), SETTINGS)
    pod_spec = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"] == {
        "claimName": "weights",
        "readOnly": True,
    }
    (container,) = pod_spec["containers"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts[wi.MODEL_CACHE_PATH]["readOnly"] is True
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DYN_MODEL_CACHE_REQUIRED"] == "true"
    assert env["DYN_MODEL_CACHE"] == wi.MODEL_CACHE_PATH
    plain = desired_deployment(stored(dynamo_worker()), SETTINGS)
    assert "DYN_MODEL_CACHE_REQUIRED" not in str(plain)


def test_a_held_deployment_is_left_out_of_the_children() -> None:
    kinds = [c["kind"] for c in desired_children(cached(), SETTINGS, hold_deployment=True)]
    assert "Deployment" not in kinds
    assert "Deployment" in [c["kind"] for c in desired_children(cached(), SETTINGS)]


def test_progress_is_the_last_progress_line() -> None:
    tail = '{"bytesDone": 10, "bytesTotal": 100}\nnoise\n{"bytesDone": 40, "bytesTotal": 100}\n'
    assert parse_progress(tail) == (40, 100)
    assert parse_progress("no progress yet") == (None, None)
    assert parse_progress(None) == (None, None)


def test_a_failure_reads_the_newest_termination_message() -> None:
    old = pod("Failed", message=json.dumps({"reason": "timeout", "message": "slow"}))
    new = pod(
        "Failed",
        message=json.dumps({"reason": "auth", "message": "S3 refused the key"}),
        created="2026-12-03T11:30:00Z",
    )
    assert failure_of([old, new, pod("Running")]) == "S3 refused the key (auth)"
    assert failure_of([pod("Failed", message="plain text")]) == "plain text"
    assert failure_of([pod("Running")]) is None


def test_retries_back_off_to_a_ceiling() -> None:
    delays = [retry_delay_seconds(n) for n in range(1, 10)]
    assert delays[:3] == [30, 60, 120]
    assert delays == sorted(delays)
    assert delays[-1] == RETRY_MAX_SECONDS


def test_the_fill_states() -> None:
    dw = cached()
    claim = {"status": {"phase": "Bound"}}
    filling = cache_state(
        dw,
        claim=claim,
        job=job(),
        fill_pods=[pod("Running")],
        log_tail='{"bytesDone": 25, "bytesTotal": 100}',
        now=NOW,
    )
    assert filling.phase is CachePhase.FILLING
    assert (filling.bytes_done, filling.bytes_total) == (25, 100)
    assert "25 of 100 bytes (25%)" in filling.message

    complete = job([{"type": "Complete", "status": "True"}])
    total = '{"bytesDone": 100, "bytesTotal": 100, "complete": true}'
    ready = cache_state(dw, claim=claim, job=complete, log_tail=total, now=NOW)
    assert ready.ready
    assert ready.bytes_total == 100

    failed_at = NOW - timedelta(seconds=10)
    failed = job(
        [{"type": "Failed", "status": "True", "lastTransitionTime": failed_at.isoformat()}],
        attempt=2,
    )
    refused = json.dumps({"reason": "auth", "message": "wrong key; fix the Secret s3-creds"})
    state = cache_state(
        dw, claim=claim, job=failed, fill_pods=[pod("Failed", message=refused)], now=NOW
    )
    assert state.phase is CachePhase.FILL_FAILED
    assert "fix the Secret s3-creds" in state.message
    assert state.retry_at == failed_at + timedelta(seconds=60)

    missing = cache_state(cached({"claimName": "weights"}), claim=None, job=None, now=NOW)
    assert missing.phase is CachePhase.VOLUME_UNAVAILABLE
    assert "weights" in missing.message
    assert "claimName" in missing.message

    unschedulable = {
        "metadata": {"name": "fill-x"},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes: pod has unbound immediate PersistentVolumeClaims",
                }
            ],
        },
    }
    state = cache_state(dw, claim=claim, job=job(), fill_pods=[unschedulable], now=NOW)
    assert state.phase is CachePhase.VOLUME_UNAVAILABLE


def test_status_reports_the_fill_and_holds_readiness() -> None:
    dw = cached()
    state = cache_state(
        dw, claim={}, job=job(), log_tail='{"bytesDone": 1, "bytesTotal": 4}', now=NOW
    )
    status = DynamoWorkerStatus.model_validate(
        compute_status(dw, WorkerObservation(now=NOW, model_cache=state))
    )
    conditions = {c.type: c for c in status.conditions}
    assert conditions["ModelCached"].status == "False"
    assert conditions["ModelCached"].reason == "Filling"
    assert conditions["Ready"].reason == "WaitingForModelCache"
    assert conditions["Progressing"].reason == "FillingModelCache"
    assert status.model_cache is not None
    assert (status.model_cache.bytes_done, status.model_cache.bytes_total) == (1, 4)
    assert status.model_cache.claim_name == "llm-model-cache"


def test_the_condition_goes_with_the_cache() -> None:
    dw = cached()
    state = cache_state(dw, claim={}, job=job(), now=NOW)
    with_cache = compute_status(dw, WorkerObservation(now=NOW, model_cache=state))
    plain = stored(dynamo_worker())
    plain.status = DynamoWorkerStatus.model_validate(with_cache)
    without = compute_status(plain, WorkerObservation(now=NOW))
    assert "ModelCached" not in [c["type"] for c in without["conditions"]]
    assert "modelCache" not in without
