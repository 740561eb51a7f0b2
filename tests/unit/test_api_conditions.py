"""Conditions per the Kubernetes API conventions: lastTransitionTime moves only with status,
and recomputing an unchanged condition changes nothing (so the operator writes nothing)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from dynamo_operator.api.common import Condition, ConditionType
from dynamo_operator.api.conditions import (
    find_condition,
    is_condition_true,
    merge_conditions,
    now,
    set_condition,
)

pytestmark = pytest.mark.unit

T0 = datetime(2025, 1, 1, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)


def test_a_new_condition_is_appended_with_the_given_time() -> None:
    conditions = set_condition([], "Ready", "False", "PodsStarting", "0/2 pods ready", at=T0)
    assert len(conditions) == 1
    ready = conditions[0]
    assert (ready.type, ready.status, ready.reason, ready.message) == (
        "Ready",
        "False",
        "PodsStarting",
        "0/2 pods ready",
    )
    assert ready.last_transition_time == T0


def test_reason_and_message_changes_keep_the_transition_time() -> None:
    first = set_condition([], "Ready", "False", "PodsStarting", "0/2", observed_generation=1, at=T0)
    second = set_condition(
        first, "Ready", "False", "ImagePullFailed", "1/2", observed_generation=2, at=T1
    )
    ready = second[0]
    assert (ready.reason, ready.message, ready.observed_generation) == ("ImagePullFailed", "1/2", 2)
    assert ready.last_transition_time == T0


def test_a_status_change_moves_the_transition_time() -> None:
    first = set_condition([], "Ready", "False", "PodsStarting", at=T0)
    second = set_condition(first, "Ready", "True", "AllPodsReady", at=T1)
    assert second[0].status == "True"
    assert second[0].last_transition_time == T1


def test_an_unchanged_condition_is_the_same_object() -> None:
    first = set_condition([], "Ready", "True", "AllPodsReady", "2/2", observed_generation=3, at=T0)
    again = set_condition(
        first, "Ready", "True", "AllPodsReady", "2/2", observed_generation=3, at=T1
    )
    assert again[0] is first[0]
    assert [c.to_dict() for c in again] == [c.to_dict() for c in first]


def test_other_conditions_keep_their_place() -> None:
    conditions = merge_conditions(
        [],
        [
            Condition(type="Ready", status="False", reason="PodsStarting", last_transition_time=T0),
            Condition(
                type="Progressing", status="True", reason="RollingOut", last_transition_time=T0
            ),
        ],
    )
    conditions = set_condition(conditions, "Degraded", "False", "AsExpected", at=T1)
    conditions = set_condition(conditions, "Ready", "True", "AllPodsReady", at=T1)
    assert [c.type for c in conditions] == ["Ready", "Progressing", "Degraded"]
    assert find_condition(conditions, "Progressing") is conditions[1]
    assert is_condition_true(conditions, ConditionType.READY)
    assert not is_condition_true(conditions, ConditionType.DEGRADED)
    assert find_condition(conditions, "Missing") is None


def test_set_condition_does_not_modify_its_input() -> None:
    original = set_condition([], "Ready", "False", "PodsStarting", at=T0)
    snapshot = [c.to_dict() for c in original]
    set_condition(original, "Ready", "True", "AllPodsReady", at=T1)
    assert [c.to_dict() for c in original] == snapshot


def test_bad_reasons_are_refused() -> None:
    with pytest.raises(ValidationError):
        set_condition([], "Ready", "False", "pods_starting")


def test_now_is_whole_seconds_in_utc() -> None:
    current = now()
    assert current.microsecond == 0
    assert current.tzinfo is UTC
    stored = set_condition([], "Ready", "True", "AllPodsReady")[0]
    assert stored.last_transition_time.microsecond == 0
