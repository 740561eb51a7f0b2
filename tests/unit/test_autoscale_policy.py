"""The autoscaler's policy: recommendation, bounds, windows, zero, no flapping."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dynamo_operator.api.autoscaling import Autoscaling
from dynamo_operator.reconcile.dynamoworker.autoscale_policy import (
    LoadReading,
    PolicyState,
    decide,
    recommend,
)


def spec(**fields: object) -> Autoscaling:
    return Autoscaling.model_validate({"maxReplicas": 8, "targetInFlightPerPod": 4, **fields})


def run(
    policy: Autoscaling,
    current: int,
    readings: list[tuple[float, LoadReading]],
    state: PolicyState | None = None,
) -> tuple[list[int], PolicyState]:
    """Feed readings at their times, applying each decision; the counts after each."""
    state = state or PolicyState()
    counts = []
    for now, load in readings:
        decision, state = decide(policy, current, load, state, now)
        current = decision.replicas
        counts.append(current)
    return counts, state


@pytest.mark.parametrize(
    ("in_flight", "current", "expected"),
    [(0, 1, 0), (4, 1, 1), (5, 1, 2), (16, 2, 4), (31.5, 8, 8), (8.2, 2, 2), (9.0, 2, 3)],
)
def test_recommendation_is_ceil_of_load_over_target(
    in_flight: float, current: int, expected: int
) -> None:
    count, reason = recommend(spec(), current, LoadReading(pods_read=current, in_flight=in_flight))
    assert count == expected
    assert "target 4 per pod" in reason


def test_held_requests_count_as_demand() -> None:
    count, reason = recommend(spec(), 0, LoadReading(held=9))
    assert count == 3
    assert "9 held" in reason


def test_the_largest_target_wins() -> None:
    both = spec(targetKvCachePercent=50)
    load = LoadReading(pods_read=2, in_flight=2, kv_cache_percent=160.0)
    count, reason = recommend(both, 2, load)
    assert count == 4
    assert "KV cache 160%" in reason


def test_ttft_over_objective_asks_for_one_more_pod() -> None:
    slo = spec(ttftP90Milliseconds=500)
    over = LoadReading(pods_read=2, in_flight=4, ttft_p90_seconds=0.9)
    assert recommend(slo, 2, over)[0] == 3
    within = LoadReading(pods_read=2, in_flight=4, ttft_p90_seconds=0.2)
    assert recommend(slo, 2, within)[0] == 1  # the in-flight target alone: 4 / 4


def test_ttft_only_target_keeps_the_count_while_met() -> None:
    slo = Autoscaling.model_validate({"maxReplicas": 4, "ttftP90Milliseconds": 500})
    assert recommend(slo, 3, LoadReading(in_flight=2, ttft_p90_seconds=0.1))[0] == 3
    assert recommend(slo, 3, LoadReading(in_flight=0, ttft_p90_seconds=0.1))[0] == 0


def test_bounds_hold_the_count() -> None:
    policy = spec(minReplicas=2, maxReplicas=3)
    counts, _ = run(policy, 2, [(0, LoadReading(in_flight=100)), (1, LoadReading())])
    assert counts[0] == 3
    decision, _ = decide(policy, 3, LoadReading(in_flight=100), PolicyState(), 0)
    assert "held at maxReplicas 3" in decision.reason


def test_a_count_outside_the_bounds_is_brought_back() -> None:
    policy = spec(minReplicas=2, maxReplicas=4, scaleDownWindowSeconds=60)
    decision, state = decide(policy, 7, LoadReading(), PolicyState(), 0)
    assert (decision.replicas, decision.direction) == (4, "Bounds")
    assert "outside [2, 4]" in decision.reason
    # and is then decided on as any other: down to the floor once the window has passed
    counts, _ = run(policy, 4, [(30, LoadReading()), (61, LoadReading())], state)
    assert counts == [4, 2]
    decision, _ = decide(policy, 1, LoadReading(), PolicyState(), 0)
    assert (decision.replicas, decision.direction) == (2, "Bounds")


def test_a_new_policy_waits_a_whole_window_before_scaling_down() -> None:
    """A new leader finds 3 pods and no load: it keeps them for the window, then lowers."""
    policy = spec(scaleDownWindowSeconds=120)
    idle = LoadReading(pods_read=3)
    counts, _ = run(policy, 3, [(1000, idle), (1060, idle), (1119, idle), (1121, idle)])
    assert counts == [3, 3, 3, 1]


def test_scale_up_is_immediate_by_default_and_down_waits_its_window() -> None:
    policy = spec(scaleDownWindowSeconds=60)
    busy, idle = LoadReading(pods_read=1, in_flight=16), LoadReading(pods_read=4, in_flight=4)
    counts, state = run(policy, 1, [(0, busy)])
    assert counts == [4]
    counts, _ = run(policy, 4, [(t, idle) for t in (10, 30, 59, 61, 71)], state)
    # The recommendation of 4 at t=0 stays in the window until t=60.
    assert counts == [4, 4, 4, 1, 1]


def test_scale_up_window_takes_the_lowest_recommendation() -> None:
    policy = spec(scaleUpWindowSeconds=30)
    counts, _ = run(
        policy,
        1,
        [
            (0, LoadReading(in_flight=4)),
            (10, LoadReading(in_flight=16)),
            (41, LoadReading(in_flight=16)),
        ],
    )
    assert counts == [1, 1, 4]


def test_no_flapping_on_a_noisy_load() -> None:
    """A load that wobbles around the target never changes the count."""
    policy = spec(scaleDownWindowSeconds=30)
    wobble = [7.7, 8.3, 7.9, 8.6, 7.5, 8.0, 8.4, 7.6]
    counts, _ = run(policy, 2, [(t * 5.0, LoadReading(in_flight=w)) for t, w in enumerate(wobble)])
    assert set(counts) == {2}


def test_scale_to_zero_after_the_idle_time_only_with_a_card() -> None:
    policy = spec(minReplicas=0, scaleToZeroAfterSeconds=120, scaleDownWindowSeconds=30)
    idle = LoadReading(pods_read=1, card_ready=True)
    counts, state = run(policy, 1, [(0, LoadReading(pods_read=1, in_flight=1, card_ready=True))])
    counts, _ = run(policy, 1, [(60, idle), (119, idle), (121, idle)], state)
    assert counts == [1, 1, 0]
    no_card = LoadReading(pods_read=1)
    decision, _ = decide(policy, 1, no_card, state, 500)
    assert decision.replicas == 1
    assert "no model card" in decision.reason


def test_idle_time_counts_from_the_first_poll_when_no_request_was_seen() -> None:
    policy = spec(minReplicas=0, scaleToZeroAfterSeconds=60)
    idle = LoadReading(pods_read=1, card_ready=True)
    counts, _ = run(policy, 1, [(1000, idle), (1059, idle), (1061, idle)])
    assert counts == [1, 1, 0]


def test_a_held_request_wakes_at_once_whatever_the_windows() -> None:
    policy = spec(minReplicas=0, scaleUpWindowSeconds=600)
    decision, state = decide(policy, 0, LoadReading(held=1, card_ready=True), PolicyState(), 0)
    assert (decision.replicas, decision.direction) == (1, "FromZero")
    assert decision.reason.startswith("woken")
    # and it stays up for the idle time once the request was answered
    decision, _ = decide(policy, 1, LoadReading(pods_read=1, card_ready=True), state, 100)
    assert decision.replicas == 1


def test_min_one_never_goes_to_zero() -> None:
    policy = spec(minReplicas=1, scaleDownWindowSeconds=0)
    counts, _ = run(policy, 3, [(t, LoadReading(card_ready=True)) for t in (0, 1000, 5000)])
    assert counts == [1, 1, 1]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"minReplicas": 5, "maxReplicas": 2}, "minReplicas must not exceed"),
        ({"targetInFlightPerPod": None}, "needs a target"),
        ({"targetInFlightPerPod": 0}, "greater than or equal to 1"),
        ({"targetKvCachePercent": 101}, "less than or equal to 100"),
        ({"scaleDownWindowSeconds": -1}, "greater than or equal to 0"),
    ],
)
def test_bad_combinations_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        spec(**fields)
