"""Advertise an engine's token-overflow contract to the Dynamo frontend.

The budget travels in the model card's `runtime_data["token_budget"]`; the Rust
preprocessor reads it to reject prompts early instead of forwarding them to the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

# Must equal the key the Rust frontend reads (`lib/llm/src/local_model/runtime_config.rs`).
TOKEN_BUDGET_RUNTIME_KEY = "token_budget"


class EngineSpecificSetter(Protocol):
    """What `publish_token_budget` needs from a runtime config: `ModelRuntimeConfig` has it."""

    def set_engine_specific(self, key: str, value: str) -> None: ...


@dataclass(frozen=True)
class TokenBudget:
    """Advertise which token-overflow requests the frontend may reject early.

    A false flag delegates that overflow dimension to the backend. The backend remains
    responsible for any clamping, truncation, or rejection after that.
    """

    combined_limit: int
    reject_prompt_overflow: bool
    reject_total_overflow: bool

    def __post_init__(self) -> None:
        if self.combined_limit < 0:
            raise ValueError("combined_limit must be non-negative")


def publish_token_budget(runtime_config: Any, token_budget: TokenBudget) -> None:
    """Publish an engine's token-overflow contract to the Dynamo frontend.

    `runtime_config` is any object with `set_engine_specific(key, json_text)` (the runtime's
    `ModelRuntimeConfig`), which parses the JSON and stores it under `runtime_data[key]`.
    """
    payload = {
        "combined_limit": token_budget.combined_limit,
        "reject_prompt_overflow": token_budget.reject_prompt_overflow,
        "reject_total_overflow": token_budget.reject_total_overflow,
    }
    runtime_config.set_engine_specific(TOKEN_BUDGET_RUNTIME_KEY, json.dumps(payload))
