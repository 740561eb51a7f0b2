"""Deciding whether a child needs applying: the rule behind "zero writes when converged".

A child is applied unless the live object already holds the desired manifest, judged by two
checks that cover each other's blind spots:

1. Every field of the desired manifest is present in the live object with the same value
   (a semantic subset: fields the API server or other controllers add are ignored; quantities
   compare by value, so `8` equals `"8"` and `"1000m"` equals `"1"`). This catches deletion
   and out-of-band edits of the fields the operator owns.
2. The live object carries the `dynamo.dev/applied-hash` annotation of the desired manifest
   (it is part of the desired manifest, so check 1 compares it). A field the operator stopped
   setting is still present in the live object, so check 1 alone would pass; the hash changes
   with any change of the desired manifest and forces the apply that removes it.

Server-side apply of an unchanged manifest is a no-op for the object, but it is still a write
request; skipping it keeps a converged cluster free of operator writes.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Mapping
from decimal import Decimal, DecimalException
from typing import Any

# A hash of the manifest the operator last applied (see the module doc).
APPLIED_HASH_ANNOTATION = "dynamo.dev/applied-hash"

_SUFFIXES = {
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}
_QUANTITY = re.compile(
    r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$"
)


def parse_quantity(value: object) -> Decimal | None:
    """A Kubernetes quantity's value, or None when `value` is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Decimal(value)
    if not isinstance(value, str):
        return None
    match = _QUANTITY.match(value)
    if match is None:
        return None
    try:
        return Decimal(match.group(1)) * _SUFFIXES[match.group(2) or ""]
    except DecimalException:
        # Past Decimal's range (Overflow), or not a number: such a string is no quantity.
        # A hash such as "5e9999999" in an annotation matches the pattern, and raising here
        # failed every reconcile of its object.
        return None


def _scalar_equal(desired: object, live: object) -> bool:
    if desired == live and type(desired) is type(live):
        return True
    if isinstance(desired, bool) or isinstance(live, bool):
        return False
    if isinstance(desired, int | str) and isinstance(live, int | str):
        a, b = parse_quantity(desired), parse_quantity(live)
        return a is not None and a == b
    return False


def difference(desired: object, live: object, path: str = "") -> str | None:
    """The path of the first field of `desired` that `live` lacks or holds with another value
    (lists compare element by element and must have the same length); None when `desired` is
    a subset of `live`."""
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return path or "."
        for key, value in desired.items():
            where = f"{path}.{key}" if path else str(key)
            if key not in live:
                return where
            found = difference(value, live[key], where)
            if found is not None:
                return found
        return None
    if isinstance(desired, list):
        if not isinstance(live, list) or len(desired) != len(live):
            return path or "."
        for index, (d, v) in enumerate(zip(desired, live, strict=True)):
            found = difference(d, v, f"{path}[{index}]")
            if found is not None:
                return found
        return None
    return None if _scalar_equal(desired, live) else (path or ".")


def is_subset(desired: object, live: object) -> bool:
    """Whether every field of `desired` is in `live` with an equal value."""
    return difference(desired, live) is None


def manifest_hash(manifest: Mapping[str, Any]) -> str:
    """A short, stable hash of a manifest (keys sorted; the hash annotation left out)."""
    body = copy.deepcopy(dict(manifest))
    metadata = body.get("metadata", {})
    annotations = metadata.get("annotations", {})
    annotations.pop(APPLIED_HASH_ANNOTATION, None)
    if "annotations" in metadata and not annotations:
        del metadata["annotations"]  # stamping added the map: hash as if it never had
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def stamped(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `manifest` carrying its own hash in the applied-hash annotation."""
    out = copy.deepcopy(dict(manifest))
    metadata = out.setdefault("metadata", {})
    annotations = metadata.setdefault("annotations", {})
    annotations[APPLIED_HASH_ANNOTATION] = manifest_hash(manifest)
    return out


def needs_apply(stamped_desired: Mapping[str, Any], live: Mapping[str, Any] | None) -> bool:
    """Whether the stamped desired manifest must be applied over `live` (None: absent)."""
    if live is None:
        return True
    return not is_subset(stamped_desired, live)
