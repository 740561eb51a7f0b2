"""Engines for the interop tests, loaded by `dynamo-worker --engine support.interop_engines:...`
(the worker runs with tests/ on PYTHONPATH)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from dynamo.common.backend import GenerateChunk, GenerateRequest
from dynamo.engines.sample import SampleEngine

# Sampling seeds that make `ScriptedEngine` fail (a client sets them with OpenAI's `seed`).
FAIL_BEFORE_OUTPUT_SEED = 4001
FAIL_AFTER_FIRST_TOKEN_SEED = 4002


class ScriptedEngine(SampleEngine):
    """The sample engine's lifecycle with scripted output: it echoes the prompt's token ids,
    one per chunk (at most `max_tokens`, finish reason "stop" at the prompt's end), so text
    goes out through the frontend's tokenizer and comes back unchanged. Seed
    `FAIL_BEFORE_OUTPUT_SEED` raises before any output, `FAIL_AFTER_FIRST_TOKEN_SEED` after
    the first token."""

    async def generate(
        self, request: GenerateRequest, context: Any
    ) -> AsyncGenerator[GenerateChunk, None]:
        seed = (request.get("sampling_options") or {}).get("seed")
        if seed == FAIL_BEFORE_OUTPUT_SEED:
            raise RuntimeError("scripted failure before any output")
        prompt = list(request.get("token_ids") or [])
        max_tokens = (request.get("stop_conditions") or {}).get("max_tokens") or len(prompt)
        echo = prompt[:max_tokens]
        for position, token in enumerate(echo):
            if seed == FAIL_AFTER_FIRST_TOKEN_SEED and position == 1:
                raise RuntimeError("scripted failure after the first token")
            if position < len(echo) - 1:
                yield {"token_ids": [token], "index": 0}
                continue
            reason = "stop" if len(echo) == len(prompt) else "length"
            yield {
                "token_ids": [token],
                "index": 0,
                "finish_reason": reason,
                "completion_usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(echo),
                    "total_tokens": len(prompt) + len(echo),
                },
            }
