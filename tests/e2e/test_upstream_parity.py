"""Differential tests against upstream Dynamo 1.6.1: the same request or call on upstream's
worker (its sample worker from the `hack/oracle-venv` venv) and on our `dynamo-worker`,
comparing status, body and label sets. Without upstream's venv these tests skip.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.tiny_model import TinyModel
from support.upstream import SAMPLE_ENGINE, UpstreamFleet, upstream_fleet
from support.worker_process import WorkerProcess

pytestmark = pytest.mark.e2e
__all__ = ["upstream_fleet"]

JSON = "application/json"

# POST /v1/loras bodies upstream's JSON extractor refuses (with the content type sent): the
# issue's three, then wrong types, shapes, positions (lines, bytes) and syntax errors.
MALFORMED_LORA_LOADS: list[tuple[bytes, str | None]] = [
    (b"{}", JSON),
    (b'{"lora_name": 3}', JSON),
    (b'{"lora_name": "a"}', JSON),
    (b'{"lora_name": "a", "source": {}}', JSON),
    (b'{"lora_name": "a", "source": {"uri": 5}}', JSON),
    (b'{"lora_name": "a", "source": "s3://b/k"}', JSON),
    (b'{"lora_name": "a", "source": []}', JSON),
    (b'{"lora_name": "a", "source": [5]}', JSON),
    (b'{"lora_name": null}', JSON),
    (b'{"lora_name": true}', JSON),
    (b'{"lora_name": -0}', JSON),
    (b'{"lora_name": 18446744073709551616}', JSON),
    (b'{"lora_name": 1e-7}', JSON),
    (b'{"lora_name": 2.5E+3}', JSON),
    (b'{"lora_name": [1]}', JSON),
    (b'{"lora_name": {"x": 1}}', JSON),
    (b'{"lora_name": "a", "lora_name": "b"}', JSON),
    (b'{"x": [1, {"y": null}], "lora_name": 7}', JSON),
    (b'{\n  "lora_name": 3\n}', JSON),
    (b'{"l\\u00f6ra": 1, "lora_name": 2}', JSON),
    ('{"name": "é", "lora_name": false}'.encode(), JSON),
    (b"[]", JSON),
    (b'["a"]', JSON),
    (b'["a", 3]', JSON),
    (b'["a", {"uri": "u"}, 3]', JSON),
    (b'"a"', JSON),
    (b"null", JSON),
    (b"", JSON),
    (b"{", JSON),
    (b"nope", JSON),
    (b'{"lora_name": "a",}', JSON),
    (b'{"lora_name" "a"}', JSON),
    (b'{"lora_name": "a" "source": 1}', JSON),
    (b"{1: 2}", JSON),
    (b'{"lora_name": tru}', JSON),
    (b'{"lora_name": 01}', JSON),
    (b'{"lora_name": 1.}', JSON),
    (b'{"lora_name": 1.', JSON),
    (b'{"lora_name": 1e400}', JSON),
    (b'{"lora_name": "\\q"}', JSON),
    (b'{"lora_name": "\\ud800"}', JSON),
    (b'{"lora_name": "\\udc00"}', JSON),
    (b'{"lora_name": "\x01"}', JSON),
    (b'{"lora_name": "\xff", "x": 1', JSON),
    (b'{"x": "\xff\\udc00"}', JSON),
    (b'{"x": [1, ]}', JSON),
    (b'{"x": {"a" 1}}', JSON),
    (b'{"x": 1e}', JSON),
    (b'{"x": 1.', JSON),
    (b'{"x": 1e', JSON),
    (b'{"x": -', JSON),
    (b'{"x": -a}', JSON),
    (b'{"x": "\\q"}', JSON),
    (b'{"x": "\\u12"}', JSON),
    (b'{"x": tru}', JSON),
    (b'{"x": [1 2]}', JSON),
    (b'{"x": {"a": 1 "b": 2}}', JSON),
    (b'{"x": {,}}', JSON),
    (b'{"x": {"a": 1,}}', JSON),
    (b'{"x": [', JSON),
    (b'{"x": {', JSON),
    (b'{"x": {"a"', JSON),
    (b'{"x": [1, 2]] , "lora_name": 1}', JSON),
    (b'{"lora_name": "\\ud800\\u0041"}', JSON),
    (b'{"lora_name": "\\ud83d\\ude00", "source": 1}', JSON),
    (b'{"lora_name": "a\\"b\\n\\u00e9", "source": "\\t"}', JSON),
    (b'{"lora_name": "a", "source": {"uri": "u"}', JSON),
    (b"{}", None),
    (b"{}", "text/plain"),
    (b"{}", "application/vnd.api+json"),
    (b"{}", "application/json; charset=utf-8"),
]


async def answer(url: str, body: bytes, content_type: str | None) -> tuple[int, str, str]:
    headers = {"Content-Type": content_type} if content_type else {}
    async with (
        aiohttp.ClientSession(skip_auto_headers=["Content-Type"]) as session,
        session.post(url, data=body, headers=headers) as response,
    ):
        return response.status, response.content_type, await response.text()


async def wait_ready(url: str, within: float = 60) -> None:
    """Poll a system server's /health until it answers 200."""
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url + "/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, f"{url}/health never answered 200"
            await asyncio.sleep(0.1)


def lora_workers(
    fleet: UpstreamFleet, tiny_model: TinyModel, tmp_path: Path
) -> tuple[str, WorkerProcess]:
    """Upstream's sample worker and ours, both with LoRA management on."""
    _, upstream = fleet.start_upstream_worker(
        tiny_model.base,
        env={"DYN_LORA_ENABLED": "true", "DYN_LORA_PATH": str(tmp_path / "upstream-loras")},
    )
    ours = fleet.start_worker(
        "--engine",
        SAMPLE_ENGINE,
        "--model",
        str(tiny_model.base),
        env={"DYN_LORA_ENABLED": "true", "DYN_LORA_PATH": str(tmp_path / "loras")},
    )
    return upstream, ours


async def test_malformed_lora_loads_are_refused_as_upstream_refuses_them(
    upstream_fleet: UpstreamFleet, tiny_model: TinyModel, tmp_path: Path
) -> None:
    upstream, ours = lora_workers(upstream_fleet, tiny_model, tmp_path)
    await wait_ready(upstream)
    await ours.wait_health(200)
    mismatches: list[Any] = []
    for body, content_type in MALFORMED_LORA_LOADS:
        theirs = await answer(upstream + "/v1/loras", body, content_type)
        mine = await answer(ours.system_url() + "/v1/loras", body, content_type)
        assert theirs[0] in (400, 415, 422), (body, theirs)
        if mine != theirs:
            mismatches.append((body, content_type, theirs, mine))
    assert not mismatches, "\n".join(map(repr, mismatches))


SERVED = "tiny-llama"


async def chat(frontend: str, model: str) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with (
        aiohttp.ClientSession() as session,
        session.post(frontend + "/v1/chat/completions", json=body) as response,
    ):
        assert response.status == 200, await response.text()
        answer: dict[str, Any] = await response.json()
        return answer


@pytest.mark.parametrize(
    "plane_flags",
    [["--request-plane", "tcp", "--event-plane", "zmq"], []],
    ids=["upstream-flags", "default-plane"],
)
async def test_upstreams_frontend_routes_to_our_worker_started_with_upstreams_flags(
    upstream_fleet: UpstreamFleet, tiny_model: TinyModel, plane_flags: list[str]
) -> None:
    # `dynamo-worker --discovery-backend file [--request-plane tcp --event-plane zmq]`, no
    # plane variables: the record advertises the TCP transport upstream's frontend reads.
    fleet = upstream_fleet
    frontend = await fleet.start_frontend()
    worker = WorkerProcess(
        [
            "--engine",
            SAMPLE_ENGINE,
            "--model",
            str(tiny_model.base),
            "--served-model-name",
            SERVED,
            "--discovery-backend",
            "file",
            *plane_flags,
        ],
        {"DYN_FILE_KV": str(fleet.kv)},
    )
    fleet.workers.append(worker)
    await fleet.wait_models(SERVED)
    answer = await chat(frontend, SERVED)
    assert answer["model"] == SERVED
    assert answer["choices"][0]["message"]["content"]


def label_sets(text: str) -> dict[str, set[frozenset[str]]]:
    """`dynamo_component_*` family -> the label-name sets of its samples (empty when the
    family is declared but has no sample yet, e.g. an error counter before any error)."""
    families: dict[str, set[frozenset[str]]] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("dynamo_component_"):
            families.setdefault(f"{family.name} ({family.type})", set())
            for sample in family.samples:
                names = frozenset(sample.labels) - {"le"}
                families.setdefault(f"{family.name} ({family.type})", set()).add(names)
    return families


async def scrape(system_url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(system_url + "/metrics") as r:
        assert r.status == 200
        return await r.text()


async def test_component_metric_label_sets_match_upstreams(
    upstream_fleet: UpstreamFleet, tiny_model: TinyModel
) -> None:
    # Both workers behind upstream's frontend, each having served a chat completion.
    fleet = upstream_fleet
    frontend = await fleet.start_frontend()
    _, upstream = fleet.start_upstream_worker(tiny_model.base)
    ours = fleet.start_worker(
        "--engine", SAMPLE_ENGINE, "--model", str(tiny_model.base), "--served-model-name", SERVED
    )
    await fleet.wait_models(SERVED, str(tiny_model.base))
    await chat(frontend, str(tiny_model.base))
    await chat(frontend, SERVED)
    theirs = label_sets(await scrape(upstream))
    mine = label_sets(await scrape(ours.system_url()))
    assert "dynamo_component_uptime_seconds (gauge)" in theirs
    assert "dynamo_component_kv_publisher_engines_dropped_events (counter)" in theirs
    # Every upstream family exists here with upstream's label names (ours adds LoRA ones).
    # A family may be declared without samples on one side only: upstream's worker now and
    # then counts a `publish_response` error when the frontend closes a finished stream,
    # which ours does not, so label names are compared where both sides have samples.
    differing = {
        name: (labels, mine.get(name))
        for name, labels in theirs.items()
        if name not in mine or (labels and mine[name] and mine[name] != labels)
    }
    assert not differing, differing
