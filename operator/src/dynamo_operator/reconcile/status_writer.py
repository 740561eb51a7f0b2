"""Writing an object's status back, for both kinds: only when it changed, and never twice.

The watch delivers an object some time after our status write lands, so a reconcile that runs
meanwhile still sees the status that write replaced. `StatusWriter.current` returns our last
write in that case; computing from it keeps condition transition times and Events right, and
does not write the same status twice. `is_echo` tells the watch event that reports our own
write, which needs no reconcile; `hold` and `held` time a change the reconciler holds back. A
status is compared as `compute` would write it (the status model's defaults filled, unknown
fields dropped), so the two compare equal exactly when a write would change nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dynamo_operator.api.base import StatusModel
from dynamo_operator.k8s import kinds
from dynamo_operator.k8s.client import ApiError, Cluster
from dynamo_operator.reconcile.errors import TransientError


def merge_patch(existing: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns `existing` into `new`: every value of `new`,
    and null for each key that went away, at any depth of nested objects (a merge patch keeps
    the keys it does not mention, and merges the objects it does)."""
    patch: dict[str, Any] = {key: None for key in existing if key not in new}
    for key, value in new.items():
        before = existing.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            patch[key] = merge_patch(before, value)
        else:
            patch[key] = value
    return patch


@dataclass
class StatusWriter:
    """Status patches of one kind, whose status is the model `status_model`."""

    cluster: Cluster
    kind: kinds.Kind
    status_model: type[StatusModel]
    monotonic: Callable[[], float] = time.monotonic
    # Per object uid: the status it had before our last write, and the status we wrote.
    _written: dict[str, tuple[dict[str, Any], dict[str, Any]]] = field(
        default_factory=dict, init=False
    )
    # Per object uid: the resourceVersion our last write gave it.
    _versions: dict[str, str] = field(default_factory=dict, init=False)
    # Per object uid: since when a status change has been held back (see `held`).
    _held_since: dict[str, float] = field(default_factory=dict, init=False)

    def normalized(self, raw: Mapping[str, Any] | None) -> dict[str, Any]:
        """A stored status as a reconcile would write it."""
        return self.status_model.model_validate(dict(raw or {})).to_dict()

    def current(self, meta: Mapping[str, Any], raw: Mapping[str, Any] | None) -> dict[str, Any]:
        """The object's status, normalized; our last write when the watch has not delivered
        it yet (the object still shows what that write replaced)."""
        status = self.normalized(raw)
        known = self._written.get(str(meta.get("uid", "")))
        if known is not None and status == known[0]:
            return known[1]
        return status

    async def write(
        self, meta: Mapping[str, Any], existing: dict[str, Any], new: dict[str, Any]
    ) -> bool:
        """Patch the status from `existing` to `new` when they differ; whether it wrote.
        Raises TransientError when the API server refused (but not for a deleted object)."""
        self._held_since.pop(str(meta.get("uid", "")), None)  # whatever was held is settled
        if new == existing:
            return False
        patch = merge_patch(existing, new)
        try:
            result = await self.cluster.patch_status(
                self.kind, str(meta["namespace"]), str(meta["name"]), patch
            )
        except ApiError as err:
            if err.status == 404:  # deleted meanwhile
                return False
            raise TransientError(str(err)) from err
        uid = str(meta.get("uid", ""))
        self._written[uid] = (existing, new)
        version = (result.get("metadata") or {}).get("resourceVersion")
        if version:
            self._versions[uid] = str(version)
        return True

    def held(self, meta: Mapping[str, Any]) -> float:
        """Seconds a change of the status of the object at `meta` has been held back, counted
        from the first `hold` after the last `write` (0 when none is)."""
        since = self._held_since.get(str(meta.get("uid", "")))
        return 0.0 if since is None else self.monotonic() - since

    def hold(self, meta: Mapping[str, Any]) -> None:
        """Note that a change of the object's status is held back (the first time counts)."""
        self._held_since.setdefault(str(meta.get("uid", "")), self.monotonic())

    def is_echo(self, meta: Mapping[str, Any]) -> bool:
        """Whether the object at `meta` is just what our last status write made of it."""
        version = meta.get("resourceVersion")
        return version is not None and self._versions.get(str(meta.get("uid", ""))) == version

    def forget(self, uid: str) -> None:
        """Drop what is remembered about a deleted object."""
        self._written.pop(uid, None)
        self._versions.pop(uid, None)
        self._held_since.pop(uid, None)
