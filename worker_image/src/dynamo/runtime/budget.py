"""Token budget enforcement on the request plane, before the engine sees a request.

The budget is the one published in the model card (`runtime_data["token_budget"]`), with
upstream's frontend semantics: a prompt of `combined_limit` tokens or more is refused when
`reject_prompt_overflow`; otherwise `prompt + (max_tokens or 1)` over the limit is refused
when `reject_total_overflow`. A request without `max_tokens` gets the rest of the budget.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from dynamo.common.token_budget import TOKEN_BUDGET_RUNTIME_KEY, TokenBudget

logger = logging.getLogger(__name__)


class TokenBudgetExceeded(ValueError):
    """The request does not fit the budget; the message states the limit."""


def budget_from_runtime_data(runtime_data: Mapping[str, Any] | None) -> TokenBudget | None:
    """The budget in a model card's runtime_data, or None (an invalid one is ignored with a
    warning, as upstream's frontend does)."""
    if not runtime_data or TOKEN_BUDGET_RUNTIME_KEY not in runtime_data:
        return None
    raw = runtime_data[TOKEN_BUDGET_RUNTIME_KEY]
    try:
        limit = raw["combined_limit"]
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise TypeError("combined_limit is not an integer")
        return TokenBudget(
            combined_limit=limit,
            reject_prompt_overflow=bool(raw.get("reject_prompt_overflow", False)),
            reject_total_overflow=bool(raw.get("reject_total_overflow", False)),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        logger.warning("ignoring invalid token budget %r: %s", raw, exc)
        return None


def enforce_token_budget(
    budget: TokenBudget | None, prompt_tokens: int, max_tokens: int | None
) -> int | None:
    """Raise `TokenBudgetExceeded` when the request breaks the budget; return the
    `max_tokens` to use (the request's, or what is left of the budget when it gave none)."""
    if budget is None:
        return max_tokens
    limit = budget.combined_limit
    if prompt_tokens >= limit:
        if budget.reject_prompt_overflow:
            raise TokenBudgetExceeded(
                f"prompt has {prompt_tokens} tokens; the token budget's combined limit is "
                f"{limit} tokens (prompt + max_tokens), so the prompt must be shorter than that"
            )
        return max_tokens
    requested = max_tokens if max_tokens is not None else 1
    if prompt_tokens + requested > limit and budget.reject_total_overflow:
        raise TokenBudgetExceeded(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({requested}) = "
            f"{prompt_tokens + requested} tokens exceeds the token budget's combined limit of "
            f"{limit} tokens; lower max_tokens to at most {limit - prompt_tokens}"
        )
    return max_tokens if max_tokens is not None else limit - prompt_tokens
