"""The OpenAI routes of a real `dynamo-worker` serving the tiny model with the transformers
engine (context length 512), as a client sees them: every request that can never succeed is
a 400 naming the field, the optional fields are honoured or refused, and a hypothesis fuzzer
over chat and completions bodies finds no 5xx, no hang, no refused valid request and no cut
stream (`DYNAMO_FUZZ_EXAMPLES` examples per route, default 300)."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from support.openai_bodies import (
    ANSWER_BOUND_SECS,
    Answer,
    fuzz_examples,
    invalid_bodies,
    post,
    valid_bodies,
)
from support.tiny_model import TinyModel, load_generator
from support.worker_process import WorkerProcess

pytestmark = pytest.mark.e2e

ENGINE = "dynamo.engines.transformers_engine:TransformersEngine"
SERVED = "tiny-llama"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
async def worker(tiny_model: TinyModel) -> AsyncIterator[WorkerProcess]:
    """One worker for the module (the engine keeps no state between requests)."""
    process = WorkerProcess(
        ["--engine", ENGINE, "--model", str(tiny_model.base), "--served-model-name", SERVED],
    )
    try:
        await process.wait_health(200, within=120)
        yield process
    finally:
        process.close()


@pytest.fixture(scope="module")
def client(worker: WorkerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=worker.http_url(),
        timeout=ANSWER_BOUND_SECS,
        headers={"Content-Type": "application/json"},
    ) as http:
        yield http


def ask(client: httpx.Client, path: str, body: Any) -> Answer:
    return post(client, path, body)


def error_of(answer: Answer) -> dict[str, Any]:
    assert isinstance(answer.body, dict), answer
    error = answer.body["error"]
    assert isinstance(error, dict)
    return error


def vocab_and_context() -> tuple[int, int]:
    generator = load_generator()
    return int(generator.TOKENIZER_VOCAB_SIZE), int(generator.CONTEXT_LENGTH)


# ----- the requests ----------------------------------------------------------------

LONG_PROMPT = "hello world " * 6000  # 12,000 tokens and more
HI = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [
        (COMPLETIONS, {"prompt": LONG_PROMPT}, "prompt", "context_length_exceeded"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": LONG_PROMPT}]},
            "messages",
            "context_length_exceeded",
        ),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 600}, "max_tokens", "context_length_exceeded"),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "top_p": 2}, "top_p", None),
        (COMPLETIONS, {"prompt": [99999999]}, "prompt", None),
        (COMPLETIONS, {"prompt": "hi", "temperature": -1}, "temperature", None),
        (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", None),
        (
            CHAT,
            {
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_object"},
            },
            "response_format",
            None,
        ),
        (COMPLETIONS, {"prompt": "hi", "n": 2}, "n", None),
        (COMPLETIONS, {"prompt": "hi", "logit_bias": {"512": 5}}, "logit_bias", None),
        (
            COMPLETIONS,
            {"prompt": "hi", "stream_options": {"include_usage": True}},
            "stream_options",
            None,
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "hi"}], "wizardry": True},
            "wizardry",
            None,
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_requests_that_can_never_succeed_are_400s_naming_the_field(
    client: httpx.Client,
    path: str,
    body: dict[str, Any],
    param: str,
    code: str | None,
    stream: bool,
) -> None:
    if stream and "stream_options" not in body:
        body = {**body, "stream": True}
    answer = ask(client, path, body)
    assert answer.status == 400, answer
    error = error_of(answer)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["code"] == (code or 400), error


def test_logprobs_are_honoured_in_chat(client: httpx.Client) -> None:
    body = {
        "messages": [{"role": "user", "content": "Tell me about the weather"}],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    answer = ask(client, CHAT, body)
    assert answer.status == 200, answer
    choice = answer.body["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == answer.body["usage"]["completion_tokens"]
    assert "".join(entry["token"] for entry in content) == choice["message"]["content"]
    for entry in content:
        # Greedy: the sampled token is the most likely one.
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert math.isclose(entry["top_logprobs"][0]["logprob"], entry["logprob"])
        assert entry["logprob"] <= 0
        assert bytes(entry["bytes"]).decode() == entry["token"]
    streamed = ask(client, CHAT, {**body, "stream": True})
    assert streamed.status == 200
    assert streamed.done
    entries = [
        e
        for event in streamed.events
        for e in (event["choices"][0]["logprobs"] or {}).get("content", [])
    ]
    assert entries == content


def test_logprobs_are_honoured_in_completions(client: httpx.Client) -> None:
    body = {"prompt": "the quick brown", "max_tokens": 5, "temperature": 0, "logprobs": 3}
    answer = ask(client, COMPLETIONS, body)
    assert answer.status == 200, answer
    choice = answer.body["choices"][0]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert len(logprobs["token_logprobs"]) == len(logprobs["tokens"]) == 5
    for token, logprob, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        # Three alternatives; those that decode alike (partial UTF-8 bytes) share a key.
        assert 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(logprob)
        assert top[token] == pytest.approx(logprob)
    assert logprobs["text_offset"] == [
        sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(logprobs["tokens"]))
    ]
    streamed = ask(client, COMPLETIONS, {**body, "stream": True})
    assert streamed.done
    tokens = [t for event in streamed.events for t in event["choices"][0]["logprobs"]["tokens"]]
    assert tokens == logprobs["tokens"]


def greedy_ids(client: httpx.Client, prompt: list[int], count: int) -> list[int]:
    """The engine's greedy tokens for `prompt` (the token-level route)."""
    body = {"token_ids": prompt, "stop_conditions": {"max_tokens": count, "ignore_eos": True}}
    response = client.post("/v1/generate", json={**body, "sampling_options": {"temperature": 0}})
    assert response.status_code == 200, response.text
    lines = [json.loads(line) for line in response.text.splitlines() if line.strip()]
    return [token for line in lines for token in line["token_ids"]]


def test_seed_stop_penalties_and_logit_bias_are_honoured(client: httpx.Client) -> None:
    base = {"prompt": "the quick brown", "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    first = ask(client, COMPLETIONS, {**base, "seed": 11})
    again = ask(client, COMPLETIONS, {**base, "seed": 11})
    assert first.status == again.status == 200
    assert first.body["choices"][0]["text"] == again.body["choices"][0]["text"]
    greedy = ask(client, COMPLETIONS, {**base, "temperature": 0})
    text = greedy.body["choices"][0]["text"]
    assert len(text) > 4
    cut = ask(client, COMPLETIONS, {**base, "temperature": 0, "stop": [text[2:4]]})
    assert cut.body["choices"][0]["text"] == text[: text.find(text[2:4])]
    assert cut.body["choices"][0]["finish_reason"] == "stop"
    prompt = [1, 40, 41, 42]
    tokens = greedy_ids(client, prompt, 6)
    greedy_body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    plain = ask(client, COMPLETIONS, greedy_body).body["choices"][0]["text"]
    banned = ask(client, COMPLETIONS, {**greedy_body, "logit_bias": {str(tokens[0]): -100}})
    assert banned.status == 200
    assert banned.body["choices"][0]["text"] != plain
    forced = ask(client, COMPLETIONS, {**greedy_body, "logit_bias": {"65": 100}, "logprobs": 0})
    assert (
        forced.body["choices"][0]["logprobs"]["tokens"]
        == [forced.body["choices"][0]["logprobs"]["tokens"][0]] * 6
    )
    if len(set(tokens)) < len(tokens):
        # A repeated greedy token: a strong frequency penalty avoids repeating it.
        penalized = ask(client, COMPLETIONS, {**greedy_body, "frequency_penalty": 2.0})
        assert penalized.body["choices"][0]["text"] != plain


# ----- the fuzzer ----------------------------------------------------------------------------


def check_answer(answer: Answer, body: Any, *, valid: bool, what: str) -> None:
    assert answer.seconds < ANSWER_BOUND_SECS, (what, body)
    assert answer.status < 500, (what, body, answer)
    if valid:
        assert answer.status == 200, (body, answer)
    else:
        assert 400 <= answer.status < 500, (what, body, answer)
        error = error_of(answer)
        assert error["type"] in ("invalid_request_error", "not_found_error"), error
        assert isinstance(error["message"], str)
        assert error["message"]
    if answer.status == 200 and isinstance(body, dict) and body.get("stream"):
        errors = [e for e in answer.events if "error" in e]
        assert answer.done or errors, ("a streamed answer ended without [DONE] or an error", body)
        assert not errors, (body, errors)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_fuzzed_bodies_get_no_5xx_no_hang_and_valid_ones_200(
    client: httpx.Client, path: str
) -> None:
    chat = path == CHAT
    vocab, context = vocab_and_context()

    @settings(
        max_examples=fuzz_examples(),
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(body=valid_bodies(chat, vocab))
    def valid(body: dict[str, Any]) -> None:
        check_answer(ask(client, path, body), body, valid=True, what="valid")

    @settings(
        max_examples=fuzz_examples(),
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=invalid_bodies(chat, vocab, context))
    def invalid(case: tuple[Any, str]) -> None:
        body, what = case
        check_answer(ask(client, path, body), body, valid=False, what=what)

    valid()
    invalid()


def test_the_worker_logged_no_internal_error(worker: WorkerProcess) -> None:
    """Nothing the tests above sent was our own fault (a 500 is logged with its request id)."""
    assert "failed in the engine" not in worker.log(), worker.log()[-4000:]
