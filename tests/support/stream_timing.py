"""One streamed OpenAI completion, timed as a client sees it: when the first token arrived,
the gaps between texts, and the completion tokens the final usage reports (the benchmarks)."""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp


@dataclass(frozen=True)
class StreamTiming:
    ttft: float
    gaps: list[float]
    tokens: int


async def timed_stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> StreamTiming:
    """POST `body` (a streamed completion that asks for usage) to `url`/v1/completions; fails
    on a non-200 answer or a stream without a token.

    The first token counts from the first chunk with a choice, text or not: a token the
    detokenizer holds back (part of a UTF-8 character) streams with empty text, and a
    one-token completion may stream no text at all. Gaps are between chunks with text."""
    started = time.perf_counter()
    first: float | None = None
    arrivals: list[float] = []
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            event = json.loads(line[len("data:") :])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event.get("choices"):
                now = time.perf_counter()
                first = first or now
                if event["choices"][0].get("text"):
                    arrivals.append(now)
    assert first is not None, f"{url}: no choice streamed"
    assert tokens, f"{url}: no token streamed (usage: 0 completion tokens)"
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return StreamTiming(first - started, gaps, tokens)
