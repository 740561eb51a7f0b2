"""The autoscaler's policy: from one reading of the pods' load to a replica count. Pure.

- **Recommendation.** For each target set, ceil(load / target): in-flight requests (the
  activator's held requests count too) over targetInFlightPerPod, the pods' summed KV cache
  percent over targetKvCachePercent. The largest wins. A TTFT p90 above its objective, with
  requests in flight, asks for one pod more than now. A load within `TOLERANCE` of the
  current pods' target keeps the current count (as the HPA does), so noise never scales.
- **Bounds.** Within [minReplicas, maxReplicas]. Zero only with minReplicas 0, once no
  request has been seen for scaleToZeroAfterSeconds, and only while the activator holds the
  model card (it can answer for the pods only with it); a held request always asks for a pod.
- **Windows.** Scaling up takes the lowest recommendation of the scale-up window, scaling
  down the highest of the scale-down window (the HPA's stabilisation), so a short dip or peak
  never moves the count. The count at the first poll counts as recommended then, so a policy
  that starts (a new DynamoWorker, a new leader after a failover) never scales down before a
  whole window of its own readings. Waking from zero skips the window: requests are waiting.
  Going to zero skips it too: the idle time is its window.
- **Bounds.** A count outside [minReplicas, maxReplicas] (an edit, kubectl scale) is taken
  as the nearest bound, then decided on as any other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dynamo_operator.api.autoscaling import Autoscaling, ScalingDirection

# A load within this fraction of the current pods' target keeps the current count.
TOLERANCE = 0.1


@dataclass(frozen=True)
class LoadReading:
    """One poll of a DynamoWorker's pods (and its activator)."""

    pods_read: int = 0
    in_flight: float = 0.0  # summed over the pods read
    kv_cache_percent: float | None = None  # summed over the pods read (each 0-100)
    ttft_p90_seconds: float | None = None  # over the pods read, since the previous poll
    held: int = 0  # requests the activator holds
    card_ready: bool = False  # the activator holds the model card

    @property
    def demand(self) -> float:
        return self.in_flight + self.held


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between polls of one DynamoWorker."""

    # (time, recommendation), newest last, trimmed to the longest window.
    recommendations: tuple[tuple[float, int], ...] = ()
    # When a request was last seen (None: not since the autoscaler started watching).
    last_active: float | None = None
    started: float | None = None  # the first poll: idle time counts from it at the latest
    # The count at the first poll: it counts as recommended then for the scale-down window,
    # so an autoscaler that starts (a new worker, a new leader after a failover) never scales
    # down before a whole window of its own readings.
    first_count: int = 0


@dataclass(frozen=True)
class Decision:
    """The count the policy wants, and why; `direction` is None when it keeps the count."""

    replicas: int
    reason: str
    direction: ScalingDirection | None = None


def _ceil(value: float) -> int:
    # 2.0000000001 from float sums is 2, not 3.
    return math.ceil(round(value, 6))


def _within_tolerance(load: float, target: float, current: int) -> bool:
    return current > 0 and abs(load / (current * target) - 1.0) <= TOLERANCE


def recommend(spec: Autoscaling, current: int, load: LoadReading) -> tuple[int, str]:
    """The count the load asks for, before bounds and windows, and the figures behind it."""
    wanted: list[tuple[int, str]] = []
    if spec.target_in_flight_per_pod is not None:
        target = spec.target_in_flight_per_pod
        count = (
            current
            if _within_tolerance(load.demand, target, current)
            else _ceil(load.demand / target)
        )
        held = f" ({load.held} held)" if load.held else ""
        wanted.append((count, f"{load.demand:g} requests in flight{held}, target {target} per pod"))
    if spec.target_kv_cache_percent is not None and load.kv_cache_percent is not None:
        target = spec.target_kv_cache_percent
        used = load.kv_cache_percent
        count = current if _within_tolerance(used, target, current) else _ceil(used / target)
        wanted.append((count, f"KV cache {used:.0f}% summed over pods, target {target}% per pod"))
    if spec.ttft_p90_milliseconds is not None and load.ttft_p90_seconds is not None:
        objective = spec.ttft_p90_milliseconds
        p90 = load.ttft_p90_seconds * 1000
        if p90 > objective and load.demand > 0:
            wanted.append((current + 1, f"TTFT p90 {p90:.0f} ms over the {objective} ms objective"))
        elif len(wanted) == 0:
            count = current if load.demand > 0 else 0
            wanted.append((count, f"TTFT p90 {p90:.0f} ms within the {objective} ms objective"))
    if not wanted:
        return (current if load.demand > 0 else 0), f"{load.demand:g} requests in flight"
    return max(wanted, key=lambda w: w[0])


def _floor(spec: Autoscaling, load: LoadReading, state: PolicyState, now: float) -> tuple[int, str]:
    """The fewest pods allowed now, and why zero is not allowed when it is not."""
    if spec.min_replicas > 0:
        return spec.min_replicas, ""
    if load.held > 0:
        return 1, "requests are held"
    if not load.card_ready:
        return 1, "the activator has no model card yet (a pod must serve once first)"
    idle_since = state.last_active if state.last_active is not None else state.started
    if idle_since is None or now - idle_since < spec.scale_to_zero_after_seconds:
        return 1, ""
    return 0, ""


def decide(
    spec: Autoscaling, current: int, load: LoadReading, state: PolicyState, now: float
) -> tuple[Decision, PolicyState]:
    """The count for now, and the state for the next poll."""
    bounds = (spec.min_replicas, spec.max_replicas)
    kept = min(max(current, bounds[0]), bounds[1])  # a count outside the bounds comes back
    if state.started is None:
        state = replace(state, started=now, first_count=kept)
    if load.demand > 0:
        state = replace(state, last_active=now)
    raw, why = recommend(spec, current, load)
    floor, floor_why = _floor(spec, load, state, now)
    bounded = min(max(raw, floor), spec.max_replicas)
    if bounded != raw:
        if bounded == spec.max_replicas and raw > bounded:
            why += f"; held at maxReplicas {spec.max_replicas}"
        elif floor_why:
            why += f"; kept at {bounded}: {floor_why}"
        else:
            why += f"; held at the floor of {bounded}"
    longest = max(spec.scale_up_window_seconds, spec.scale_down_window_seconds)
    history = tuple((t, r) for t, r in state.recommendations if now - t <= longest)
    history += ((now, bounded),)
    state = replace(state, recommendations=history)

    decision = _stabilised(spec, kept, bounded, why, history, state, now)
    if kept != current:
        reason = (
            f"{current} replicas is outside [{spec.min_replicas}, {spec.max_replicas}] "
            f"(spec.autoscaling owns the count); {decision.reason}"
        )
        return Decision(decision.replicas, reason, "Bounds"), state
    return decision, state


def _stabilised(
    spec: Autoscaling,
    current: int,
    bounded: int,
    why: str,
    history: tuple[tuple[float, int], ...],
    state: PolicyState,
    now: float,
) -> Decision:
    """The windows applied to the bounded recommendation."""
    if bounded == current:
        return Decision(current, why)
    if current == 0:
        return Decision(bounded, f"woken: {why}", "FromZero")
    if bounded == 0:
        return Decision(0, f"no request for {spec.scale_to_zero_after_seconds} s", "ToZero")
    if bounded > current:
        window = [r for t, r in history if now - t <= spec.scale_up_window_seconds]
        target = max(current, min(window))
        direction: ScalingDirection = "Up"
    else:
        window = [r for t, r in history if now - t <= spec.scale_down_window_seconds]
        if state.started is not None and now - state.started < spec.scale_down_window_seconds:
            window.append(state.first_count)
        target = min(current, max(window))
        direction = "Down"
    if target == current:
        return Decision(current, f"{why}; waiting out the {direction.lower()} window")
    return Decision(target, why, direction)
