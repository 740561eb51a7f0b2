"""Differential test over upstream's TCP request plane: upstream's frontend (ai-dynamo 1.6.1,
`hack/oracle-venv`) in front of our vLLM worker and of upstream's own vLLM worker (`python -m
dynamo.vllm`, `hack/upstream-vllm-venv`), the same tiny model and engine arguments, each under
its own served name. The issue's bad requests (a prompt past the context, `top_p: 2`, a token
id past the vocabulary) must show the client the same status and error type through the
frontend for both workers. Skipped without either venv.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from support import vllm
from support.tiny_model import TINY_MODEL_SEED, load_generator
from support.upstream import UpstreamFleet, upstream_fleet

pytestmark = pytest.mark.e2e
__all__ = ["upstream_fleet"]

OURS = "tiny-ours"
THEIRS = "tiny-upstream"
HI = [{"role": "user", "content": "hi"}]
LONG = "hello world " * 3000
LONG_CHAT = {"messages": [{"role": "user", "content": LONG}]}

BAD_REQUESTS: list[tuple[str, str, dict[str, Any]]] = [
    ("prompt past the context", "/v1/completions", {"prompt": LONG, "max_tokens": 4}),
    ("messages past the context", "/v1/chat/completions", LONG_CHAT),
    ("top_p 2", "/v1/chat/completions", {"messages": HI, "top_p": 2, "max_tokens": 4}),
    ("token id past the vocabulary", "/v1/completions", {"prompt": [99999999], "max_tokens": 4}),
]


async def error_of(frontend: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """The status and the error's `type` (None when the body has none) the client sees."""
    timeout = aiohttp.ClientTimeout(total=120)
    async with (
        aiohttp.ClientSession() as session,
        session.post(frontend + path, json=body, timeout=timeout) as response,
    ):
        text = await response.text()
    try:
        answer: Any = json.loads(text)
    except ValueError:
        answer = text
    error = answer.get("error", answer) if isinstance(answer, dict) else answer
    kind = error.get("type") if isinstance(error, dict) else None
    return response.status, kind


async def test_bad_requests_through_upstreams_frontend_match_upstreams_vllm_worker(
    upstream_fleet: UpstreamFleet, tmp_path: Path
) -> None:
    load_generator().write_tiny_model(tmp_path / "model", TINY_MODEL_SEED, head_dim=64)
    model = tmp_path / "model" / "base"
    frontend = await vllm.start_behind_frontend(
        upstream_fleet, model, tmp_path, ours=OURS, theirs=THEIRS
    )
    table: list[str] = []
    mismatches: list[str] = []
    for name, path, body in BAD_REQUESTS:
        ours = await error_of(frontend, path, {**body, "model": OURS})
        theirs = await error_of(frontend, path, {**body, "model": THEIRS})
        table.append(f"{name}: ours {ours}, upstream's worker {theirs}")
        if ours != theirs:
            mismatches.append(table[-1])
    print("\n".join(table))
    assert not mismatches, "\n".join([*mismatches, "", upstream_fleet.logs()[-6000:]])
