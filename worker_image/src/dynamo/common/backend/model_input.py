"""The kind of input a served model accepts (mirrors `dynamo.llm.ModelInput`)."""

from __future__ import annotations

from enum import Enum


class ModelInput(Enum):
    """What the frontend sends to the worker's `generate` endpoint.

    `Tokens`: the frontend tokenizes (LLM engines). `Text` / `Tensor`: the request body
    is forwarded as-is (raw media engines).
    """

    Tokens = "tokens"
    Text = "text"
    Tensor = "tensor"
