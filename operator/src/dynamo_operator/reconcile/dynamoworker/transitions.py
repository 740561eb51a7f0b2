"""Which condition transitions of a DynamoWorker are worth a Kubernetes Event (pure).

An Event is recorded when a condition changes status: Ready turning True or False, a rollout
starting or finishing, Degraded appearing or clearing. A condition seen for the first time is
recorded only when it is news (Ready or Progressing True, Degraded True), so creating a
worker does not start with a row of "not ready yet" events. The Event itself is built by
`reconcile.events`.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynamo_operator.api.common import Condition, ConditionType

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


def note(condition: Condition) -> str:
    """The Event's note about `condition`."""
    return f"{condition.type}={condition.status}: {condition.message}"
