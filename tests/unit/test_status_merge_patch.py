"""The status writer's merge patch: what goes away at any depth is named with null, so the API
server (which merges objects key by key) drops it too."""

from __future__ import annotations

import pytest

from dynamo_operator.reconcile.status_writer import merge_patch

pytestmark = pytest.mark.unit


def apply_merge_patch(target: object, patch: object) -> object:
    """RFC 7386's algorithm, as the API server applies a merge patch."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = apply_merge_patch(result.get(key), value)
    return result


@pytest.mark.parametrize(
    ("existing", "new"),
    [
        ({"a": 1, "b": 2}, {"a": 1}),
        ({"modelCache": {"key": "k2", "staleKey": "k1"}}, {"modelCache": {"key": "k2"}}),
        ({"x": {"y": {"z": 1, "w": 2}}}, {"x": {"y": {"z": 1}}}),
        ({"conditions": [{"type": "A"}, {"type": "B"}]}, {"conditions": [{"type": "A"}]}),
        ({"frontend": {"url": "u"}}, {}),
        ({}, {"frontend": {"url": "u"}}),
    ],
)
def test_the_patch_turns_existing_into_new(existing: dict, new: dict) -> None:
    assert apply_merge_patch(existing, merge_patch(existing, new)) == new
