"""Kubernetes Events about the operator's own objects (events.k8s.io/v1), for both kinds.

`event_manifest` is the one builder (pure); `EventRecorder` creates Events through the API
client, best effort: an Event that cannot be recorded is logged and never fails a reconcile.
What is worth an Event is each kind's business (`dynamoworker.transitions`, the LoRAAdapter
reconciler's load and unload results).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from dynamo_operator.k8s import kinds
from dynamo_operator.k8s.client import ApiError, Cluster

logger = logging.getLogger(__name__)

REPORTING_CONTROLLER = "dynamo.dev/dynamo-operator"
NOTE_MAX = 1024


@dataclass(frozen=True)
class Regarding:
    """The object an Event is about."""

    kind: kinds.Kind
    namespace: str
    name: str
    uid: str

    @classmethod
    def of(cls, kind: kinds.Kind, meta: Mapping[str, Any]) -> Regarding:
        """The object of `kind` whose metadata is `meta`."""
        return cls(
            kind,
            str(meta.get("namespace", "")),
            str(meta.get("name", "")),
            str(meta.get("uid", "")),
        )


def event_manifest(
    regarding: Regarding,
    *,
    reason: str,
    note: str,
    event_type: str,
    action: str,
    now: datetime,
    reporting_instance: str,
) -> dict[str, Any]:
    """An events.k8s.io/v1 Event about `regarding` (`event_type`: Normal or Warning)."""
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {
            "name": f"{regarding.name}.{secrets.token_hex(8)}",
            "namespace": regarding.namespace,
        },
        "eventTime": now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": reporting_instance[:128],
        "action": action,
        "reason": reason[:128],
        "type": event_type,
        "note": note[:NOTE_MAX],
        "regarding": {
            "apiVersion": regarding.kind.api_version,
            "kind": regarding.kind.kind,
            "name": regarding.name,
            "namespace": regarding.namespace,
            "uid": regarding.uid,
        },
    }


def event_time_now() -> datetime:
    """The current time to the microsecond, not to the second conditions are stored with:
    Events are ordered by their eventTime, and a worker's creation and its readiness can
    fall within one second."""
    return datetime.now(UTC)


@dataclass
class EventRecorder:
    """Records Events as `reporting_instance` (the operator pod's name)."""

    cluster: Cluster
    reporting_instance: str = "dynamo-operator"
    clock: Callable[[], datetime] = event_time_now

    async def record(
        self,
        regarding: Regarding,
        *,
        reason: str,
        note: str,
        action: str,
        warning: bool = False,
    ) -> None:
        manifest = event_manifest(
            regarding,
            reason=reason,
            note=note,
            event_type="Warning" if warning else "Normal",
            action=action,
            now=self.clock(),
            reporting_instance=self.reporting_instance,
        )
        try:
            await self.cluster.create_event(regarding.namespace, manifest)
        except ApiError as err:  # events are best effort
            logger.warning("Event not recorded: %s", err)
