"""Setting and merging status conditions per the Kubernetes API conventions.

A condition's `lastTransitionTime` moves only when its `status` changes; a new reason or
message keeps it. A condition that does not change at all is returned as the same object, so
recomputing a converged status yields an equal status and the operator writes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from dynamo_operator.api.common import Condition, ConditionStatus


def now() -> datetime:
    """The current time at the precision conditions are stored with (seconds, UTC)."""
    return datetime.now(UTC).replace(microsecond=0)


def find_condition(conditions: Iterable[Condition], type_: str) -> Condition | None:
    """The condition of `type_`, or None."""
    return next((c for c in conditions if c.type == type_), None)


def is_condition_true(conditions: Iterable[Condition], type_: str) -> bool:
    """Whether the condition of `type_` exists and is True."""
    found = find_condition(conditions, type_)
    return found is not None and found.status == "True"


def set_condition(
    conditions: Sequence[Condition],
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str = "",
    *,
    observed_generation: int | None = None,
    at: datetime | None = None,
) -> list[Condition]:
    """A copy of `conditions` with `type_` set; others keep their place, a new type goes last.

    `at` is the transition time used when the status changes (now by default); it is ignored
    when the status stays the same.
    """
    wanted = Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        observed_generation=observed_generation,
        last_transition_time=at or now(),
    )
    return merge_conditions(conditions, [wanted])


def merge_conditions(existing: Sequence[Condition], wanted: Iterable[Condition]) -> list[Condition]:
    """`existing` updated with each of `wanted` (by type).

    A wanted condition whose status equals the existing one keeps the existing
    `lastTransitionTime`; one equal in every field keeps the existing object. Conditions not
    in `wanted` stay as they are, in their place; new types are appended in the order given.
    """
    merged = list(existing)
    for condition in wanted:
        index = next((i for i, c in enumerate(merged) if c.type == condition.type), None)
        if index is None:
            merged.append(condition)
            continue
        current = merged[index]
        if current.status == condition.status:
            condition = condition.model_copy(
                update={"last_transition_time": current.last_transition_time}
            )
        if condition != current:
            merged[index] = condition
    return merged


@dataclass(frozen=True)
class WantedCondition:
    """A condition as a reconciler computes it, before generation and time are stamped."""

    type: str
    status: ConditionStatus
    reason: str
    message: str


def apply_conditions(
    existing: Sequence[Condition],
    wanted: Iterable[WantedCondition],
    *,
    generation: int | None,
    at: datetime,
) -> list[Condition]:
    """`existing` merged with `wanted`, each stamped with `generation` and time `at`."""
    return merge_conditions(
        existing,
        [
            Condition(
                type=w.type,
                status=w.status,
                reason=w.reason,
                message=w.message,
                observed_generation=generation,
                last_transition_time=at,
            )
            for w in wanted
        ],
    )


def name_list(names: Sequence[str], shown: int = 3) -> str:
    """`a, b, c and 2 more`: a few names for a status message."""
    more = len(names) - shown
    listed = ", ".join(names[:shown])
    return f"{listed} and {more} more" if more > 0 else listed
