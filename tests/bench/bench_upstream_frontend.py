"""Tokens/s through upstream Dynamo's frontend (ai-dynamo 1.6.1) to our worker vs to
upstream's own sample worker, measured in the same run behind the same frontend.

Run: `.venv/bin/pytest -m bench -s tests/bench/bench_upstream_frontend.py` (needs the venv
`hack/oracle-venv` makes). Both workers run a zero-cost engine (no per-token delay): ours
the sample engine, upstream's its sample engine, each serving the tiny model's tokenizer
under its own model name. Load: CONCURRENCY clients each sending unary completions of
TOKENS tokens (`ignore_eos`) for WINDOW_SECS, alternating ours/upstream ROUNDS times; the
figure is completion tokens/s (the best window of each). Nothing is asserted about speed;
the goal is ours >= 0.9x upstream.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from support import bench_plots
from support.tiny_model import TinyModel
from support.upstream import SAMPLE_ENGINE, UpstreamFleet, upstream_fleet

pytestmark = pytest.mark.bench
__all__ = ["upstream_fleet"]

CONCURRENCY = 16
TOKENS = 256
WINDOW_SECS = 8.0
ROUNDS = 3
OURS = "ours-bench"


async def tokens_per_second(frontend: str, model: str) -> float:
    """Completion tokens/s of CONCURRENCY clients over one WINDOW_SECS window."""
    body = {"model": model, "prompt": [40, 41, 42], "max_tokens": TOKENS, "ignore_eos": True}
    deadline = time.monotonic() + WINDOW_SECS
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client() -> int:
            tokens = 0
            while time.monotonic() < deadline:
                async with session.post(frontend + "/v1/completions", json=body) as response:
                    answer = await response.json()
                assert response.status == 200, answer
                tokens += answer["usage"]["completion_tokens"]
            return tokens

        started = time.monotonic()
        counts = await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
        return sum(counts) / (time.monotonic() - started)


async def test_tokens_per_second_ours_vs_upstream_worker(
    upstream_fleet: UpstreamFleet, tiny_model: TinyModel
) -> None:
    fleet = upstream_fleet
    frontend = await fleet.start_frontend()
    upstream_model = str(tiny_model.base)
    fleet.start_upstream_worker(tiny_model.base, "--delay", "0", "--max-tokens", str(TOKENS))
    fleet.start_worker(
        "--engine",
        SAMPLE_ENGINE,
        "--model",
        str(tiny_model.base),
        "--served-model-name",
        OURS,
        "--token-delay",
        "0",
        "--max-num-seqs",
        "1024",
        env={"DYN_LOG": "warning"},
    )
    await fleet.wait_models(upstream_model, OURS)
    # Warm both paths (connection pools, tokenizer caches) before measuring.
    await tokens_per_second(frontend, OURS)
    await tokens_per_second(frontend, upstream_model)
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(ROUNDS):
        ours.append(await tokens_per_second(frontend, OURS))
        theirs.append(await tokens_per_second(frontend, upstream_model))
    best_ours, best_theirs = max(ours), max(theirs)
    print(
        f"\nupstream frontend -> worker, {CONCURRENCY} clients x {TOKENS}-token completions:\n"
        f"  our worker:      {best_ours:10.0f} tokens/s (windows: {[round(x) for x in ours]})\n"
        f"  upstream worker: {best_theirs:10.0f} tokens/s (windows: {[round(x) for x in theirs]})\n"
        f"  ratio ours/upstream: {best_ours / best_theirs:.2f} (goal >= 0.90)"
    )
    bench_plots.throughput(
        ("upstream worker (baseline)", best_theirs),
        [("our worker", best_ours)],
        f"Upstream frontend -> worker, {CONCURRENCY} clients x {TOKENS} tokens",
        "bench-upstream-frontend",
    )
