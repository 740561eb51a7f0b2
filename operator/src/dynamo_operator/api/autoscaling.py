"""`spec.autoscaling` of a DynamoWorker and what status reports of it.

With spec.autoscaling the operator's autoscaler owns spec.replicas: it reads each pod's load
from the workers' system port and writes the replica count between minReplicas and
maxReplicas. Without it, spec.replicas (and the /scale subresource, for kubectl scale, an HPA
or a KEDA ScaledObject) belong to the user and the operator never writes them.

Targets are integers (requests, percent, milliseconds) so that a manifest, the CRD schema and
the policy's arithmetic agree exactly; the API server's bounds refuse a target of 0 or below
with the field's name.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dynamo_operator.api.base import ApiModel, Rule, StatusModel
from dynamo_operator.api.common import JSON_SAFE_INT_MAX, MAX_REPLICAS, Timestamp
from dynamo_operator.api.pod import PodOverrides

MAX_WINDOW_SECONDS = 86400
DEFAULT_SCALE_DOWN_WINDOW_SECONDS = 300
DEFAULT_SCALE_TO_ZERO_AFTER_SECONDS = 300
DEFAULT_MAX_HELD_REQUESTS = 256
DEFAULT_HOLD_TIMEOUT_SECONDS = 300

ScalingDirection = Literal["Up", "Down", "ToZero", "FromZero", "Bounds"]


class Autoscaling(ApiModel):
    """Scale the worker pods on their own load. desired = ceil(load / target) for each target
    set (the largest wins), held within [minReplicas, maxReplicas]. minReplicas 0 scales to
    zero after scaleToZeroAfterSeconds without a request; an activator then holds requests
    (up to maxHeldRequests, each for up to holdTimeoutSeconds) while a pod starts."""

    min_replicas: int = Field(
        default=1,
        ge=0,
        le=MAX_REPLICAS,
        description="Fewest worker pods; 0 scales to zero when idle (requests are held).",
    )
    max_replicas: int = Field(ge=1, le=MAX_REPLICAS, description="Most worker pods.")
    target_in_flight_per_pod: int | None = Field(
        default=None,
        ge=1,
        le=100000,
        description="Concurrent requests per pod (in flight plus queued in the engine).",
    )
    target_kv_cache_percent: int | None = Field(
        default=None,
        ge=1,
        le=100,
        description="KV cache utilisation per pod, in percent of its blocks.",
    )
    ttft_p90_milliseconds: int | None = Field(
        default=None,
        ge=1,
        le=3600000,
        description="Time-to-first-token objective: while the pods' p90 over the last poll "
        "exceeds it, one more pod is asked for (within maxReplicas).",
    )
    scale_up_window_seconds: int = Field(
        default=0,
        ge=0,
        le=MAX_WINDOW_SECONDS,
        description="Scale up to the lowest count recommended over this window (0: at once).",
    )
    scale_down_window_seconds: int = Field(
        default=DEFAULT_SCALE_DOWN_WINDOW_SECONDS,
        ge=0,
        le=MAX_WINDOW_SECONDS,
        description="Scale down to the highest count recommended over this window.",
    )
    scale_to_zero_after_seconds: int = Field(
        default=DEFAULT_SCALE_TO_ZERO_AFTER_SECONDS,
        ge=0,
        le=MAX_WINDOW_SECONDS,
        description="With minReplicas 0: the time without any request before the pods go.",
    )
    max_held_requests: int = Field(
        default=DEFAULT_MAX_HELD_REQUESTS,
        ge=1,
        le=100000,
        description="With minReplicas 0: requests held at zero at most; more are refused (503).",
    )
    hold_timeout_seconds: int = Field(
        default=DEFAULT_HOLD_TIMEOUT_SECONDS,
        ge=1,
        le=3600,
        description="With minReplicas 0: how long a request is held for a pod to become ready "
        "before it ends with 503 and Retry-After.",
    )
    activator_pod: PodOverrides | None = Field(
        default=None,
        description="With minReplicas 0: additions to the activator's pod (a small CPU pod). "
        "Place it on nodes that stay up while the worker is at zero, not on GPU nodes a "
        "cluster autoscaler may remove.",
    )

    cel_rules = (
        Rule(
            rule="!has(self.minReplicas) || self.minReplicas <= self.maxReplicas",
            message="spec.autoscaling.minReplicas must not exceed spec.autoscaling.maxReplicas",
            check=lambda a: a.min_replicas <= a.max_replicas,
            field_path=".minReplicas",
        ),
        Rule(
            rule="has(self.targetInFlightPerPod) || has(self.targetKvCachePercent) || "
            "has(self.ttftP90Milliseconds)",
            message="spec.autoscaling needs a target: set targetInFlightPerPod, "
            "targetKvCachePercent or ttftP90Milliseconds",
            check=lambda a: any(
                t is not None
                for t in (
                    a.target_in_flight_per_pod,
                    a.target_kv_cache_percent,
                    a.ttft_p90_milliseconds,
                )
            ),
        ),
    )


class PodLoad(StatusModel):
    """The load the autoscaler last read, averaged over the pods that answered."""

    in_flight_per_pod: str | None = Field(
        default=None, max_length=32, description="Requests in flight or queued, per pod."
    )
    kv_cache_percent: int | None = Field(
        default=None, ge=0, le=100, description="KV cache utilisation per pod, in percent."
    )
    ttft_p90_milliseconds: int | None = Field(
        default=None,
        ge=0,
        le=JSON_SAFE_INT_MAX,
        description="Time to first token, p90 since the previous read.",
    )
    held_requests: int = Field(
        default=0, ge=0, le=JSON_SAFE_INT_MAX, description="Requests the activator holds."
    )
    pods_read: int = Field(
        default=0, ge=0, le=2 * MAX_REPLICAS, description="Pods whose load was read."
    )


class ScalingDecision(StatusModel):
    """One change of the replica count the autoscaler made."""

    time: Timestamp = Field(description="When it was made.")
    from_replicas: int = Field(ge=0, le=MAX_REPLICAS, description="The count before.")
    to_replicas: int = Field(ge=0, le=MAX_REPLICAS, description="The count after.")
    direction: ScalingDirection = Field(description="Up, Down, ToZero, FromZero or Bounds.")
    reason: str = Field(max_length=1024, description="Why, with the figures.")


class AutoscalingStatus(StatusModel):
    """What the autoscaler wants and why."""

    desired_replicas: int = Field(
        ge=0, le=MAX_REPLICAS, description="The replica count the autoscaler wants now."
    )
    load: str = Field(
        default="",
        max_length=128,
        description="The current load against the target, e.g. '3.5/4 in-flight per pod'.",
    )
    current: PodLoad | None = Field(default=None, description="The load last read.")
    last_decision: ScalingDecision | None = Field(
        default=None, description="The last change of the replica count."
    )
