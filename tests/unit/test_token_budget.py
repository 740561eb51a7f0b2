"""`TokenBudget` validation and its publication into a runtime config's engine data."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from dynamo.common.token_budget import TOKEN_BUDGET_RUNTIME_KEY, TokenBudget, publish_token_budget

pytestmark = pytest.mark.unit


class RecordingRuntimeConfig:
    """Behaves like `ModelRuntimeConfig.set_engine_specific`: parse the JSON, store it."""

    def __init__(self) -> None:
        self.runtime_data: dict[str, Any] = {}
        self.calls: list[tuple[str, str]] = []

    def set_engine_specific(self, key: str, value: str) -> None:
        self.calls.append((key, value))
        self.runtime_data[key] = json.loads(value)


def test_runtime_key_matches_frontend() -> None:
    assert TOKEN_BUDGET_RUNTIME_KEY == "token_budget"


def test_negative_limit_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"^combined_limit must be non-negative$"):
        TokenBudget(combined_limit=-1, reject_prompt_overflow=True, reject_total_overflow=True)


def test_zero_limit_is_allowed_and_budget_is_frozen() -> None:
    budget = TokenBudget(0, False, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        budget.combined_limit = 5  # type: ignore[misc]


def test_publish_writes_json_under_token_budget_key() -> None:
    config = RecordingRuntimeConfig()
    publish_token_budget(config, TokenBudget(8192, True, False))
    assert len(config.calls) == 1
    key, text = config.calls[0]
    assert key == "token_budget"
    assert json.loads(text) == {
        "combined_limit": 8192,
        "reject_prompt_overflow": True,
        "reject_total_overflow": False,
    }
    assert config.runtime_data["token_budget"]["combined_limit"] == 8192
