"""The hand-over to zero: the last worker pod serves until the activator stands in (pure).

When spec.replicas becomes 0 on a DynamoWorker with an activator, the operator marks the
activator's EndpointSlice scaled to zero (`activator`), and the activator steps in at once,
while the pods still serve: it publishes its discovery record, then turns its endpoint in
that slice ready. Until that endpoint is ready the worker Deployment keeps one pod, so there
is no moment when neither a pod nor the activator takes a request. The hold is bounded: an
activator that is not ready within `HAND_OVER_TIMEOUT_SECONDS` (not running, no model card,
no access to the API) cannot keep a GPU pod forever; the pod then goes anyway.
"""

from __future__ import annotations

from enum import Enum

# Stepping in takes the activator two writes after a watch event, well under a second; this
# covers a slow API server and an activator pod that is restarting.
HAND_OVER_TIMEOUT_SECONDS = 30.0


class HandOver(Enum):
    """Where a DynamoWorker's hand-over to its activator stands."""

    NONE = "none"  # nothing to hand over: pods are wanted, or none is left to keep
    WAITING = "waiting"  # the last pod serves until the activator is ready
    DONE = "done"  # the activator is ready: the last pod may go
    TIMED_OUT = "timed out"  # the activator was not ready in time: the last pod goes anyway


def hand_over(
    *,
    desired: int,
    has_activator: bool,
    deployment_replicas: int,
    activator_ready: bool,
    waited_seconds: float,
) -> HandOver:
    """The hand-over of a DynamoWorker whose spec.replicas is `desired`, whose worker
    Deployment asks for `deployment_replicas` now (0: its pods are already going), and whose
    activator's endpoint is ready or not; `waited_seconds` since this hand-over began."""
    if desired > 0 or not has_activator or deployment_replicas == 0:
        return HandOver.NONE
    if activator_ready:
        return HandOver.DONE
    if waited_seconds >= HAND_OVER_TIMEOUT_SECONDS:
        return HandOver.TIMED_OUT
    return HandOver.WAITING
