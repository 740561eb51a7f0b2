"""Kubernetes Events for significant condition transitions of a DynamoWorker (pure builders).

An Event is recorded when a condition changes status: Ready turning True or False, a rollout
starting or finishing, Degraded appearing or clearing. A condition seen for the first time is
recorded only when it is news (Ready or Progressing True, Degraded True), so creating a
worker does not start with a row of "not ready yet" events.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from dynamo_operator.api.common import API_VERSION, Condition, ConditionType
from dynamo_operator.api.dynamoworker import KIND

REPORTING_CONTROLLER = "dynamo.dev/dynamo-operator"
NOTE_MAX = 1024
_FIRST_SEEN_NEWS = {
    (ConditionType.READY, "True"),
    (ConditionType.PROGRESSING, "True"),
    (ConditionType.DEGRADED, "True"),
}


def _event_type(condition: Condition) -> str:
    if condition.type == ConditionType.DEGRADED and condition.status == "True":
        return "Warning"
    if condition.type == ConditionType.READY and condition.status == "False":
        return "Warning"
    if condition.reason == "ProgressDeadlineExceeded":
        return "Warning"
    return "Normal"


def transitions(old: Sequence[Condition], new: Sequence[Condition]) -> list[tuple[Condition, str]]:
    """The conditions of `new` worth an Event, with the Event type (Normal or Warning)."""
    before = {c.type: c for c in old}
    out = []
    for condition in new:
        previous = before.get(condition.type)
        if previous is None:
            if (condition.type, condition.status) not in _FIRST_SEEN_NEWS:
                continue
        elif previous.status == condition.status:
            continue
        out.append((condition, _event_type(condition)))
    return out


def _micro_time(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def event_manifest(
    owner: Mapping[str, Any],
    condition: Condition,
    event_type: str,
    *,
    now: datetime,
    reporting_instance: str,
) -> dict[str, Any]:
    """An events.k8s.io/v1 Event about the DynamoWorker `owner` (its metadata)."""
    name = str(owner["name"])
    note = f"{condition.type}={condition.status}: {condition.message}"
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": f"{name}.{secrets.token_hex(8)}", "namespace": owner["namespace"]},
        "eventTime": _micro_time(now),
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": reporting_instance[:128],
        "action": "Reconcile",
        "reason": condition.reason[:128],
        "type": event_type,
        "note": note[:NOTE_MAX],
        "regarding": {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": name,
            "namespace": owner["namespace"],
            "uid": owner["uid"],
        },
    }
