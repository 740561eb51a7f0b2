"""The KV-transfer monitor: each role's KV-cache transfers of a disaggregated DynamoWorker.

Runs in the leading operator replica, every few seconds per DynamoWorker with spec.prefill
(`handlers.dynamoworker`'s kv_transfer daemon). One step reads the vLLM NixlConnector counters
of both roles' ready pods through the shared `LoadReader`, sums them per role, and notes when
a failed transfer or an expired request appeared since the previous step (per pod, so a pod
that restarted counts from zero again; the counters of a pod that was already there when the
monitor first looked are taken as they are, whenever it first reads them).

What status shows (`status.kvTransfer`, `status.prefill.kvTransfer`) is kept here, in memory,
and written by the reconciler (the one writer of status) when `on_change` wakes it: at once
when a role's health changes, and at most every `STATUS_REFRESH_SECONDS` for changed counters.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from dynamo_operator.api.conditions import now as utc_now
from dynamo_operator.api.dynamoworker import DECODE, PREFILL, WorkerRole
from dynamo_operator.api.kv_transfer import (
    FAILURE_WINDOW_SECONDS,
    KvTransferHealth,
    KvTransferStatus,
)
from dynamo_operator.pods.load import KvTransferCounts, LoadReader
from dynamo_operator.reconcile.dynamoworker.pod_summary import PodSummary

logger = logging.getLogger(__name__)

STATUS_REFRESH_SECONDS = 60.0
Key = tuple[str, str]  # (namespace, name)
KvTransferView = Mapping[WorkerRole, KvTransferStatus]


def failures(counts: KvTransferCounts) -> float:
    """What makes a role Failing: failed transfers and expired requests."""
    return counts.failed_transfers + counts.expired_requests


def new_failures(before: KvTransferCounts | None, after: KvTransferCounts) -> float:
    """Failures that appeared on one pod between two reads (`before` None: a pod not read
    before, whose counters all began since; lower counters: the pod restarted)."""
    if before is None or failures(after) < failures(before):
        return failures(after)
    return failures(after) - failures(before)


def role_status(
    readings: Sequence[KvTransferCounts], last_failure: datetime | None, now: datetime
) -> KvTransferStatus:
    """One role's status from its pods' counters and the time a failure last appeared."""
    health: KvTransferHealth = "Unknown"
    if readings:
        window = timedelta(seconds=FAILURE_WINDOW_SECONDS)
        recent = last_failure is not None and now - last_failure < window
        health = "Failing" if recent else "Healthy"
    return KvTransferStatus(
        health=health,
        transfers=round(sum(r.transfers for r in readings)),
        bytes_transferred=round(sum(r.bytes_transferred for r in readings)),
        failed_transfers=round(sum(r.failed_transfers for r in readings)),
        expired_requests=round(sum(r.expired_requests for r in readings)),
        pods_read=len(readings),
        last_failure_time=last_failure,
    )


@dataclass
class _Tracked:
    """What the monitor keeps of one DynamoWorker between steps."""

    counts: dict[str, KvTransferCounts] = field(default_factory=dict)  # per pod uid
    # Pods there at the first step, not read since: what they counted before is no news.
    unread_since_start: set[str] = field(default_factory=set)
    last_failure: dict[WorkerRole, datetime] = field(default_factory=dict)
    view: KvTransferView | None = None
    shown: KvTransferView | None = None  # the view `on_change` last woke the reconciler for
    shown_at: datetime | None = None


@dataclass
class KvTransferMonitor:
    """Reads the KV-transfer counters of DynamoWorkers with spec.prefill; one per operator."""

    reader: LoadReader
    on_change: Callable[[str, str], None] = lambda namespace, name: None
    clock: Callable[[], datetime] = utc_now
    _tracked: dict[Key, _Tracked] = field(default_factory=dict, init=False)

    def view(self, namespace: str, name: str) -> KvTransferView | None:
        """What status should show per role (None: nothing read yet in this process)."""
        tracked = self._tracked.get((namespace, name))
        return None if tracked is None else tracked.view

    def forget(self, namespace: str, name: str) -> None:
        """Drop a DynamoWorker that is gone or no longer disaggregated."""
        self._tracked.pop((namespace, name), None)

    async def step(self, namespace: str, name: str, pods: Sequence[PodSummary]) -> None:
        """Read the ready pods of both roles and update the view."""
        ready = [p for p in pods if p.ready and not p.terminating and p.ip and p.role]
        answers = await asyncio.gather(*(self.reader.pod(p.ip or "") for p in ready))
        now = self.clock()
        tracked = self._tracked.get((namespace, name))
        if tracked is None:
            tracked = self._tracked[namespace, name] = _Tracked(
                unread_since_start={p.uid for p in pods}
            )
        counts: dict[str, KvTransferCounts] = {}
        by_role: dict[WorkerRole, list[KvTransferCounts]] = {PREFILL: [], DECODE: []}
        for pod, reading in zip(ready, answers, strict=True):
            if reading is None or pod.role is None:
                continue  # unreadable: left out, not counted as healthy
            counts[pod.uid] = reading.kv_transfer
            by_role[pod.role].append(reading.kv_transfer)
            if pod.uid in tracked.unread_since_start:
                tracked.unread_since_start.discard(pod.uid)
            elif new_failures(tracked.counts.get(pod.uid), reading.kv_transfer):
                tracked.last_failure[pod.role] = now
                logger.warning(
                    "DynamoWorker %s/%s: KV-cache transfer failures on %s pod %s",
                    namespace,
                    name,
                    pod.role,
                    pod.name,
                )
        # A pod not read this time keeps its last counters, so a missed read is no restart.
        alive = {p.uid for p in pods}
        tracked.counts = {uid: c for uid, c in tracked.counts.items() if uid in alive} | counts
        tracked.unread_since_start &= alive
        tracked.view = {
            role: role_status(readings, tracked.last_failure.get(role), now)
            for role, readings in by_role.items()
        }
        self._maybe_show(namespace, name, tracked, now)

    def _maybe_show(self, namespace: str, name: str, tracked: _Tracked, now: datetime) -> None:
        view, shown = tracked.view or {}, tracked.shown or {}
        if view == shown:
            return
        health_changed = {r: s.health for r, s in view.items()} != {
            r: s.health for r, s in shown.items()
        }
        stale = tracked.shown_at is None or (
            (now - tracked.shown_at).total_seconds() >= STATUS_REFRESH_SECONDS
        )
        if health_changed or stale:
            tracked.shown, tracked.shown_at = view, now
            self.on_change(namespace, name)
