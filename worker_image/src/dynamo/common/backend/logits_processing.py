"""Backend-neutral logits-processor activation data.

An engine declares a `LogitsProcessorSpec` once (from `LLMEngine.logits_processor_spec`)
and asks `logits_processors_for_request` which entries to realize for each request. Each
backend turns entries into its own processor objects, with fresh state per request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dynamo.common.constants import DisaggregationMode

_FORCED_SEQUENCE_KIND = "forced_sequence"


@dataclass(frozen=True)
class ForcedTokenSequenceSpec:
    """Force the output to `token_ids`, then end with `eos_token_id`."""

    token_ids: tuple[int, ...]
    eos_token_id: int


@dataclass(frozen=True)
class PythonProcessorSpec:
    """An in-process processor built by `factory`; it cannot be serialized."""

    factory: Callable[[], Any]


LogitsProcessorEntry = ForcedTokenSequenceSpec | PythonProcessorSpec


@dataclass(frozen=True)
class LogitsProcessorSpec:
    """Engine-declared processors; `generation_only` skips roles that emit no visible tokens."""

    entries: tuple[LogitsProcessorEntry, ...]
    generation_only: bool = True


_GENERATION_STAGES = frozenset({DisaggregationMode.AGGREGATED, DisaggregationMode.DECODE})


def is_generation_stage(disaggregation_mode: DisaggregationMode) -> bool:
    """True for roles that emit the visible output stream (aggregated, decode)."""
    return disaggregation_mode in _GENERATION_STAGES


def logits_processors_for_request(
    spec: LogitsProcessorSpec | None, *, disaggregation_mode: DisaggregationMode
) -> list[LogitsProcessorEntry]:
    """Entries to realize for one request: none without a spec or on a skipped role."""
    if spec is None:
        return []
    if spec.generation_only and not is_generation_stage(disaggregation_mode):
        return []
    return list(spec.entries)


def serialize_logits_processor_entries(
    entries: Sequence[LogitsProcessorEntry],
) -> list[dict[str, Any]]:
    """Encode entries as JSON-safe dicts; TypeError for entries that cannot be serialized."""
    payload: list[dict[str, Any]] = []
    for entry in entries:
        if not isinstance(entry, ForcedTokenSequenceSpec):
            raise TypeError(
                f"cannot serialize logits-processor entry of type {type(entry).__name__}; "
                "only ForcedTokenSequenceSpec can cross a process boundary"
            )
        payload.append(
            {
                "kind": _FORCED_SEQUENCE_KIND,
                "token_ids": list(entry.token_ids),
                "eos_token_id": entry.eos_token_id,
            }
        )
    return payload


def deserialize_logits_processor_entries(
    payload: Sequence[dict[str, Any]],
) -> list[LogitsProcessorEntry]:
    """Decode `serialize_logits_processor_entries` output; ValueError on an unknown kind."""
    entries: list[LogitsProcessorEntry] = []
    for item in payload:
        kind = item.get("kind")
        if kind != _FORCED_SEQUENCE_KIND:
            raise ValueError(
                f"unknown logits-processor entry kind {kind!r}; expected {_FORCED_SEQUENCE_KIND!r}"
            )
        entries.append(
            ForcedTokenSequenceSpec(
                token_ids=tuple(int(token) for token in item["token_ids"]),
                eos_token_id=int(item["eos_token_id"]),
            )
        )
    return entries
