"""Differential test: a corpus of bad requests (`support.bad_requests.CORPUS`, about 50) sent to
our vLLM worker's OpenAI routes and to vLLM's own OpenAI server (`python -m
vllm.entrypoints.openai.api_server`), both started here on the head_dim-64 tiny model with the
same engine arguments. For each request the status class is the same, and so is `param`
where vLLM sets one; where we differ on purpose the corpus says why, and ours must then be a
4xx naming the field. Skipped (naming the script) without `hack/vllm-venv`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest

from support import vllm
from support.bad_requests import CORPUS, SERVED, Answer, answer
from support.tiny_model import TINY_MODEL_SEED, load_generator
from support.upstream import stop_processes

pytestmark = pytest.mark.e2e

# vLLM names some fields by its own names; ours names what the client sent.
SAME_PARAM = {
    "input_tokens": {"prompt", "messages"},
    "input_text": {"prompt", "messages"},
    "max_tokens": {"max_completion_tokens"},
    "logprobs": {"top_logprobs"},
}


def field_of(param: str | None) -> str | None:
    """The top-level body field a `param` names: vLLM's validation errors say
    `body.messages.0.role`, ours `messages[0].role`; `body` alone (or `body.1`, a position in
    text that is not JSON) names no field."""
    if param is None or param == "body":
        return None
    name = param.removeprefix("body.").replace("[", ".").split(".")[0]
    return None if name.isdigit() else name


@dataclass(frozen=True)
class Servers:
    ours: str
    theirs: str


@pytest.fixture(scope="module")
async def servers(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Servers]:
    python = vllm.vllm_python_or_skip()
    root = tmp_path_factory.mktemp("vllm-parity")
    load_generator().write_tiny_model(root / "model", TINY_MODEL_SEED, head_dim=64)
    model = root / "model" / "base"
    ours = vllm.start_our_worker(python, model, root / "ours.log", served_name=SERVED)
    started = [ours]
    try:
        theirs = vllm.start_vllm_server(
            python, model, root / "vllm.log", served_name=SERVED, avoid=ours
        )
        started.append(theirs)
        await asyncio.gather(vllm.wait_ready(ours), vllm.wait_ready(theirs))
        yield Servers(ours.url, theirs.url)
    finally:
        stop_processes(served.process for served in started)


def same_param(ours: Answer, theirs: Answer) -> bool:
    """Where vLLM names a field, ours names the same one."""
    their_field = field_of(theirs.param)
    if their_field is None:
        return True
    our_field = field_of(ours.param)
    return our_field == their_field or our_field in SAME_PARAM.get(their_field, set())


async def test_bad_requests_get_what_vllms_own_server_answers(servers: Servers) -> None:
    assert len(CORPUS) >= 50
    mismatches: list[str] = []
    table: list[str] = []
    async with aiohttp.ClientSession() as session:
        for request in CORPUS:
            ours = await answer(session, servers.ours, request)
            theirs = await answer(session, servers.theirs, request)
            table.append(
                f"{request.name}: ours {ours.status} {ours.param}, vLLM {theirs.status} "
                f"{theirs.param}"
            )
            assert ours.status < 500, (request.name, ours)
            if request.param is not None and ours.param != request.param:
                mismatches.append(f"{request.name}: our param {ours.param} != {request.param}")
            if request.differs is not None:
                # On purpose: ours is a 4xx, and vLLM still answers otherwise.
                assert 400 <= ours.status < 500, (request.name, ours)
                if ours.status_class == theirs.status_class and same_param(ours, theirs):
                    mismatches.append(f"{request.name}: noted as differing, but vLLM agrees")
                continue
            if ours.status_class != theirs.status_class:
                mismatches.append(f"{request.name}: ours {ours} / vLLM {theirs}")
            elif not same_param(ours, theirs):
                mismatches.append(f"{request.name}: param {ours.param} / vLLM {theirs.param}")
    print("\n".join(table))
    assert not mismatches, "\n".join([*mismatches, "", *table])
