"""spec.model.cache: the claim the operator creates, the fill Job of each cache key, and the
fill's state as status shows it. Pure: the reconciler does the reads and writes.

The worker image's `dynamo-model-cache fill` fetches spec.model.source into `<claim>/<key>/`,
where the key is the first 16 hex digits of the source's sha256 (the worker computes the same).
It writes aside and renames into place once every object is verified, so a key directory that
exists is complete. It prints its progress as one JSON line a second, and on failure leaves a
JSON termination message (`{"reason", "message"}`), exiting 2 when no retry can help (wrong
credentials, no such object). The worker pods mount the claim read-only and load their key's
directory without downloading (DYN_MODEL_CACHE_REQUIRED); the reconciler creates or changes
their Deployment only once the current key's fill has completed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from dynamo_operator.api.dynamoworker import DynamoWorker
from dynamo_operator.reconcile.dynamoworker import interface as wi
from dynamo_operator.reconcile.dynamoworker import manifests as m
from dynamo_operator.reconcile.dynamoworker.builders import VOLUME_MODEL_CACHE, worker_image
from dynamo_operator.reconcile.dynamoworker.interface import Env
from dynamo_operator.reconcile.dynamoworker.labels import (
    PREFIX,
    cache_pod_labels,
    fill_job_name,
    model_cache_claim_name,
    prune_job_name,
)
from dynamo_operator.reconcile.dynamoworker.settings import ReconcileSettings

Manifest = dict[str, Any]

CACHE_KEY_DIGITS = 16
CACHE_CONTAINER = "cache"
CACHE_COMMAND = "dynamo-model-cache"
# The fill's exit code for a failure no retry can help; the Job fails at once on it.
PERMANENT_EXIT_CODE = 2
# Transient failures (a dropped connection, a checksum mismatch) are retried by the Job
# controller, with its own backoff (10 s, doubling), this many times.
FILL_BACKOFF_LIMIT = 4
# A failed Job is replaced after a delay that doubles per attempt, so that a fixed Secret is
# picked up without anyone deleting anything, and a wrong one costs no tight loop.
RETRY_FIRST_SECONDS = 30
RETRY_MAX_SECONDS = 1800
ATTEMPT_ANNOTATION = f"{PREFIX}fill-attempt"
SOURCE_ANNOTATION = f"{PREFIX}model-source"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
# While a fill runs, its progress is read this often.
PROGRESS_POLL_SECONDS = 5.0


class CachePhase(StrEnum):
    """The reasons of the ModelCached condition."""

    FILLING = "Filling"
    READY = "Ready"
    FILL_FAILED = "FillFailed"
    VOLUME_UNAVAILABLE = "VolumeUnavailable"


def cache_key(source: str) -> str:
    """The directory of `source` on the cache volume (the worker's `cache_key`)."""
    return hashlib.sha256(source.encode()).hexdigest()[:CACHE_KEY_DIGITS]


def desired_claim(dw: DynamoWorker) -> Manifest | None:
    """The claim the operator creates (spec.model.cache.size); None for an existing claim.
    It goes with the DynamoWorker (owner reference), and so do the weights on it."""
    cache = dw.spec.model.cache
    if cache is None or cache.size is None:
        return None
    worker, _, _ = m.identity(dw)
    spec: Manifest = {
        "accessModes": [cache.access_mode],
        "resources": {"requests": {"storage": m.quantity(cache.size)}},
    }
    if cache.storage_class_name is not None:
        spec["storageClassName"] = cache.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": m.object_metadata(dw, model_cache_claim_name(worker)),
        "spec": spec,
    }


def _cache_job(
    dw: DynamoWorker,
    settings: ReconcileSettings,
    name: str,
    args: list[str],
    env: list[Manifest],
    annotations: dict[str, str],
) -> Manifest:
    """A Job of `dynamo-model-cache <args>` on the cache volume. The pod runs the worker image
    as the worker pods do (same user, security context and scheduling, so a ReadWriteOnce
    volume lands on their node), with no API token."""
    cache = dw.spec.model.cache
    assert cache is not None
    worker, _, _ = m.identity(dw)
    container: Manifest = {
        "name": CACHE_CONTAINER,
        "image": worker_image(dw, settings),
        "command": [CACHE_COMMAND, *args, "--cache", wi.MODEL_CACHE_PATH],
        "env": [{"name": str(Env.HOME), "value": wi.TMP_PATH}, *env],
        "securityContext": dict(m.CONTAINER_SECURITY_CONTEXT),
        "volumeMounts": [
            {"name": m.VOLUME_TMP, "mountPath": wi.TMP_PATH},
            {"name": VOLUME_MODEL_CACHE, "mountPath": wi.MODEL_CACHE_PATH},
        ],
    }
    if dw.spec.image_pull_policy is not None:
        container["imagePullPolicy"] = dw.spec.image_pull_policy
    claim = model_cache_claim_name(worker, cache.claim_name)
    pod_spec: Manifest = {
        # The namespace's default identity with no token: the Job may start before the
        # workers' ServiceAccount exists, and needs no API at all.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "restartPolicy": "Never",
        "securityContext": dict(m.POD_SECURITY_CONTEXT),
        "containers": [container],
        "volumes": [
            {"name": m.VOLUME_TMP, "emptyDir": {}},
            {"name": VOLUME_MODEL_CACHE, "persistentVolumeClaim": {"claimName": claim}},
        ],
        **m.scheduling(dw.spec.pod),
    }
    if settings.worker_image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in settings.worker_image_pull_secrets]
    metadata = m.object_metadata(dw, name)
    metadata["annotations"] = annotations
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata,
        "spec": {
            "backoffLimit": FILL_BACKOFF_LIMIT,
            # A replacement pod starts only once the failed one is gone: never two writers.
            "podReplacementPolicy": "Failed",
            "podFailurePolicy": {
                "rules": [
                    {
                        "action": "FailJob",
                        "onExitCodes": {
                            "containerName": CACHE_CONTAINER,
                            "operator": "In",
                            "values": [PERMANENT_EXIT_CODE],
                        },
                    }
                ]
            },
            "template": {"metadata": {"labels": cache_pod_labels(worker)}, "spec": pod_spec},
        },
    }


def desired_fill_job(dw: DynamoWorker, settings: ReconcileSettings, attempt: int) -> Manifest:
    """The Job that fills the cache for the current source, with the DynamoWorker's
    credentials by reference (`attempt`: its count of tries, kept in an annotation for the
    retry delay)."""
    worker, _, _ = m.identity(dw)
    source = dw.spec.model.source
    return _cache_job(
        dw,
        settings,
        fill_job_name(worker, cache_key(source)),
        ["fill", "--source", source],
        m.credential_env(dw.spec),
        {SOURCE_ANNOTATION: source, ATTEMPT_ANNOTATION: str(attempt)},
    )


def desired_prune_job(dw: DynamoWorker, settings: ReconcileSettings) -> Manifest:
    """The Job that removes every directory but the current source's from a claim the
    operator owns, once the pods have rolled onto it."""
    worker, _, _ = m.identity(dw)
    key = cache_key(dw.spec.model.source)
    return _cache_job(dw, settings, prune_job_name(worker, key), ["prune", "--keep", key], [], {})


def attempt_of(job: Mapping[str, Any]) -> int:
    annotations = (job.get("metadata") or {}).get("annotations") or {}
    try:
        return max(1, int(annotations.get(ATTEMPT_ANNOTATION, "1")))
    except ValueError:
        return 1


def retry_delay_seconds(attempt: int) -> int:
    """How long after the `attempt`-th failed Job the next one starts."""
    return int(min(RETRY_MAX_SECONDS, RETRY_FIRST_SECONDS * 2 ** max(0, attempt - 1)))


@dataclass(frozen=True)
class CacheState:
    """The fill of the current cache key, as status shows it. `retry_at`: when a failed fill
    is tried again."""

    key: str
    claim: str
    phase: CachePhase
    message: str
    bytes_done: int | None = None
    bytes_total: int | None = None
    retry_at: datetime | None = None
    # The key of an earlier source whose directory awaits removal.
    stale_key: str | None = None

    @property
    def ready(self) -> bool:
        return self.phase is CachePhase.READY


def _job_condition(job: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("type") == type_ and condition.get("status") == "True":
            return dict(condition)
    return None


def is_complete(job: Mapping[str, Any]) -> bool:
    """Whether the fill Job has succeeded."""
    return _job_condition(job, "Complete") is not None


def parse_progress(log_tail: str | None) -> tuple[int | None, int | None]:
    """(bytes done, bytes total) from the last progress line of the fill's log."""
    for line in reversed((log_tail or "").splitlines()):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "bytesTotal" in record:
            done, total = record.get("bytesDone"), record.get("bytesTotal")
            return (
                done if isinstance(done, int) else None,
                total if isinstance(total, int) else None,
            )
    return None, None


def _termination(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == CACHE_CONTAINER:
            terminated = (status.get("state") or {}).get("terminated")
            if terminated:
                return dict(terminated)
    return None


def failure_of(pods: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the newest failed fill pod failed, from its termination message."""
    failed = [p for p in pods if (p.get("status") or {}).get("phase") == "Failed"]
    if not failed:
        return None
    newest = max(failed, key=lambda p: str((p.get("metadata") or {}).get("creationTimestamp")))
    terminated = _termination(newest) or {}
    text = str(terminated.get("message") or "").strip()
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if isinstance(record, dict) and record.get("message"):
        reason = record.get("reason")
        return f"{record['message']} ({reason})" if reason else str(record["message"])
    if text:
        return text[-500:]
    return f"the fill exited with code {terminated.get('exitCode', 'unknown')}"


def _unschedulable(pods: Sequence[Mapping[str, Any]]) -> str | None:
    for pod in pods:
        for condition in (pod.get("status") or {}).get("conditions") or []:
            if condition.get("type") == "PodScheduled" and condition.get("reason") == (
                "Unschedulable"
            ):
                return str(condition.get("message") or "no node fits")
    return None


def progress_pod(pods: Sequence[Mapping[str, Any]]) -> str | None:
    """The fill pod whose log holds the progress: the running one, else the one that
    succeeded (its last line has the total)."""
    for phase in ("Running", "Succeeded"):
        for pod in pods:
            if (pod.get("status") or {}).get("phase") == phase:
                return str((pod.get("metadata") or {}).get("name"))
    return None


def _progress_message(source: str, done: int | None, total: int | None) -> str:
    if total is None:
        return f"fetching {source} into the cache"
    percent = f" ({100 * (done or 0) // total}%)" if total else ""
    return f"fetching {source} into the cache: {done or 0} of {total} bytes{percent}"


def stale_key(dw: DynamoWorker) -> str | None:
    """The key whose directory should go from the operator's claim: the one status last
    reported, if the source changed since (or the one it still awaits removal of). None for
    an existing claim: the operator never removes anything from a claim it does not own."""
    cache = dw.spec.model.cache
    reported = dw.status.model_cache if dw.status is not None else None
    if cache is None or cache.claim_name is not None or reported is None:
        return None
    current = cache_key(dw.spec.model.source)
    stale = reported.key if reported.key != current else reported.stale_key
    return stale if stale != current else None  # back to an earlier source: nothing to drop


def rolled_out(dw: DynamoWorker, deployment: Mapping[str, Any] | None) -> bool:
    """Whether every worker pod runs the current spec, so none loads an older directory."""
    if deployment is None:
        return False
    status = deployment.get("status") or {}
    generation = int((deployment.get("metadata") or {}).get("generation") or 0)
    return (
        int(status.get("observedGeneration") or 0) >= generation
        and int(status.get("replicas") or 0) == dw.spec.replicas
        and int(status.get("updatedReplicas") or 0) == dw.spec.replicas
    )


def cache_state(
    dw: DynamoWorker,
    *,
    claim: Mapping[str, Any] | None,
    job: Mapping[str, Any] | None,
    fill_pods: Sequence[Mapping[str, Any]] = (),
    log_tail: str | None = None,
    now: datetime,
) -> CacheState:
    """Where the fill of the current source stands, from the live claim, Job and fill pods."""
    cache = dw.spec.model.cache
    assert cache is not None
    worker, _, _ = m.identity(dw)
    source = dw.spec.model.source
    key = cache_key(source)
    claim_ = model_cache_claim_name(worker, cache.claim_name)

    def state(phase: CachePhase, message: str, **kw: Any) -> CacheState:
        return CacheState(key=key, claim=claim_, phase=phase, message=message, **kw)

    if claim is None and cache.claim_name is not None:
        return state(
            CachePhase.VOLUME_UNAVAILABLE,
            f"the PersistentVolumeClaim {claim_} (spec.model.cache.claimName) does not exist; "
            "create it or name an existing claim",
        )
    if claim is not None and (claim.get("status") or {}).get("phase") == "Lost":
        return state(
            CachePhase.VOLUME_UNAVAILABLE,
            f"the PersistentVolumeClaim {claim_} lost its volume; delete the claim (the "
            "operator recreates one it owns) or bind it to a volume again",
        )
    if job is None:
        return state(CachePhase.FILLING, f"starting the fill of {source}")
    if is_complete(job):
        done, total = parse_progress(log_tail)
        return state(
            CachePhase.READY,
            f"{source} is in the cache (claim {claim_}, {key}/)",
            bytes_done=done,
            bytes_total=total,
        )
    failed = _job_condition(job, "Failed")
    if failed is not None:
        attempt = attempt_of(job)
        since = _parse_time(failed.get("lastTransitionTime")) or now
        retry_at = since + timedelta(seconds=retry_delay_seconds(attempt))
        why = failure_of(fill_pods) or str(failed.get("message") or failed.get("reason"))
        return state(
            CachePhase.FILL_FAILED,
            f"the fill of {source} failed: {why}; the operator tries again at "
            f"{retry_at:%Y-%m-%dT%H:%M:%SZ} (attempt {attempt + 1})",
            retry_at=retry_at,
        )
    unschedulable = _unschedulable(fill_pods)
    if unschedulable is not None and "volume" in unschedulable.lower():
        return state(
            CachePhase.VOLUME_UNAVAILABLE,
            f"the fill pod cannot be scheduled: {unschedulable}; check the claim {claim_} "
            "(storage class, size, access mode) and `kubectl describe pvc`",
        )
    done, total = parse_progress(log_tail)
    message = _progress_message(source, done, total)
    previous = failure_of(fill_pods)
    if previous is not None:
        message += f"; retrying after: {previous}"
    return state(CachePhase.FILLING, message, bytes_done=done, bytes_total=total)


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
