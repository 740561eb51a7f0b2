"""Streaming detokenization, stop strings, the token budget and OpenAI request parsing."""

from __future__ import annotations

import pytest

from dynamo.common.token_budget import TokenBudget
from dynamo.engines.sample_tokenizer import SampleTokenizer
from dynamo.runtime.budget import (
    TokenBudgetExceeded,
    budget_from_runtime_data,
    enforce_token_budget,
)
from dynamo.runtime.errors import RequestError
from dynamo.runtime.http_plane import openai
from dynamo.runtime.http_plane.detokenize import IncrementalDetokenizer, StopStringFilter
from dynamo.runtime.models import ServedModels
from dynamo.runtime.request_limits import ALL_FEATURES, RequestLimits
from dynamo.runtime.tokenizer import Tokenizer

pytestmark = pytest.mark.unit


def test_sample_tokenizer_round_trip_and_protocol() -> None:
    tokenizer = SampleTokenizer()
    assert isinstance(tokenizer, Tokenizer)
    text = "héllo wörld ✓"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<s>" + text
    assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt == "<|system|>be brief\n<|user|>hi\n<|assistant|>"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.decode([10_000])


def test_incremental_detokenizer_holds_back_partial_utf8() -> None:
    tokenizer = SampleTokenizer()
    text = "añb✓c"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add([token]) for token in ids]
    # Multi-byte characters appear only once complete, never as U+FFFD.
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)
    assert deltas.count("") == 1 + 2  # ñ is 2 bytes, ✓ is 3
    assert detokenizer.flush() == ""


def test_incremental_detokenizer_flushes_a_dangling_sequence() -> None:
    tokenizer = SampleTokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer)
    partial = tokenizer.encode("✓", add_special_tokens=False)[:2]
    assert detokenizer.add(partial) == ""
    assert detokenizer.flush() == "\ufffd"


@pytest.mark.parametrize(
    ("pieces", "stops", "emitted", "stopped"),
    [
        (["hel", "lo wo", "rld"], ["lo w"], "hel", True),
        (["a", "b", "c", "d"], ["cd"], "ab", True),
        (["a", "b", "c"], ["bd"], "abc", False),
        (["x", "y"], [], "xy", False),
        (["ab", "cX", "Y"], ["XY", "c"], "ab", True),
    ],
)
def test_stop_string_filter(
    pieces: list[str], stops: list[str], emitted: str, stopped: bool
) -> None:
    stop_filter = StopStringFilter(stops)
    out = "".join(stop_filter.feed(piece) for piece in pieces) + stop_filter.flush()
    assert out == emitted
    assert stop_filter.stopped is stopped


def test_stop_filter_never_shows_a_partial_stop_string() -> None:
    stop_filter = StopStringFilter(["END"])
    assert stop_filter.feed("abcE") == "abc"
    assert stop_filter.feed("N") == ""
    assert stop_filter.feed("x") == "ENx"


def test_token_budget_rules() -> None:
    prompt_only = TokenBudget(10, reject_prompt_overflow=True, reject_total_overflow=False)
    total = TokenBudget(10, reject_prompt_overflow=False, reject_total_overflow=True)
    with pytest.raises(TokenBudgetExceeded, match="combined limit is 10 tokens"):
        enforce_token_budget(prompt_only, 10, 1)
    assert enforce_token_budget(prompt_only, 9, 50) == 50
    with pytest.raises(
        TokenBudgetExceeded, match=r"exceeds the token budget's combined limit of 10"
    ):
        enforce_token_budget(total, 8, 3)
    assert enforce_token_budget(total, 8, 2) == 2
    # Without max_tokens, 1 is checked and the rest of the budget is granted.
    assert enforce_token_budget(total, 8, None) == 2
    # Upstream: a prompt at/over the limit is only refused by reject_prompt_overflow.
    assert enforce_token_budget(total, 10, None) is None
    assert enforce_token_budget(None, 10_000, None) is None


def test_budget_from_runtime_data() -> None:
    data = {"token_budget": {"combined_limit": 5, "reject_total_overflow": True}}
    assert budget_from_runtime_data(data) == TokenBudget(5, False, True)
    assert budget_from_runtime_data({}) is None
    assert budget_from_runtime_data({"token_budget": {"combined_limit": "5"}}) is None
    assert budget_from_runtime_data({"token_budget": "nope"}) is None


def test_openai_parsing() -> None:
    body = {
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 3,
        "stop": "\n",
        "max_tokens": 7,
        "ignore_eos": True,
        "n": 1,
    }
    parsed = openai.parse_text_request(body, RequestLimits(), chat=False)
    assert parsed.sampling_options == {"temperature": 0.5, "top_p": 0.9, "seed": 3}
    assert parsed.stop_conditions == {"max_tokens": 7, "stop": ["\n"], "ignore_eos": True}
    assert parsed.stops == ["\n"]
    assert (parsed.stream, parsed.include_usage, parsed.top_logprobs) == (False, False, None)
    assert openai.max_tokens_of({"max_completion_tokens": 4}, chat=True) == 4
    assert openai.max_tokens_of({"max_completion_tokens": 4}, chat=False) is None
    assert openai.completion_prompt({"prompt": ["hi"]}) == "hi"
    assert openai.completion_prompt({"prompt": [1, 2]}) == [1, 2]
    messages = openai.chat_messages(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}]}
    )
    assert messages == [{"role": "user", "content": "ab"}]


def test_openai_parsing_of_the_optional_fields() -> None:
    every = RequestLimits(features=ALL_FEATURES)
    chat = {
        "logprobs": True,
        "top_logprobs": 3,
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
        "logit_bias": {"5": -100},
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "u-1",
    }
    parsed = openai.parse_text_request(chat, every, chat=True)
    assert parsed.output_options == {"logprobs": 3}
    assert parsed.sampling_options == {
        "logit_bias": {"5": -100},
        "guided_decoding": {"json": {"type": "object"}},
    }
    assert (parsed.stream, parsed.include_usage, parsed.top_logprobs) == (True, True, 3)
    completion = {"logprobs": 2, "response_format": {"type": "json_object"}}
    parsed = openai.parse_text_request(completion, every, chat=False)
    assert parsed.top_logprobs == 2
    assert parsed.sampling_options == {"guided_decoding": {"json_object": True}}
    # "text" is the default, which every engine produces.
    text = openai.parse_text_request(
        {"response_format": {"type": "text"}}, RequestLimits(), chat=True
    )
    assert text.sampling_options == {}


@pytest.mark.parametrize(
    ("body", "param", "chat"),
    [
        ({"n": 2}, "n", False),
        ({"temperature": "hot"}, "temperature", False),
        ({"best_of": 3}, "best_of", False),
        ({"echo": True}, "echo", False),
        ({"stop": [1]}, "stop", False),
        ({"stop": ""}, "stop", False),
        ({"max_tokens": 0}, "max_tokens", False),
        ({"max_completion_tokens": 0}, "max_completion_tokens", True),
        ({"wizardry": 1}, "wizardry", True),
        ({"top_logprobs": 2}, "top_logprobs", False),
        ({"top_logprobs": 2}, "top_logprobs", True),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", True),
        ({"logprobs": 1}, "logprobs", True),
        ({"logprobs": True}, "logprobs", False),
        ({"logprobs": -1}, "logprobs", False),
        ({"response_format": {"type": "json_object"}}, "response_format", True),
        ({"response_format": {"type": "yaml"}}, "response_format", True),
        ({"stream_options": {"include_usage": True}}, "stream_options", True),
        ({"stream": True, "stream_options": {"bogus": True}}, "stream_options", True),
        ({"stream": "yes"}, "stream", True),
        ({"tools": [{"type": "function"}]}, "tools", True),
        ({"tool_choice": "required"}, "tool_choice", True),
        ({"user": 5}, "user", True),
        ({"logit_bias": [1]}, "logit_bias", True),
    ],
)
def test_openai_bad_parameters(body: dict[str, object], param: str, chat: bool) -> None:
    limits = RequestLimits(features=ALL_FEATURES - {"response_format"})
    with pytest.raises(RequestError) as info:
        openai.parse_text_request(body, limits, chat=chat)
    assert info.value.param == param
    assert info.value.status == 400


@pytest.mark.parametrize(
    ("request_", "param", "code"),
    [
        ({"token_ids": [1] * 20}, "prompt", "context_length_exceeded"),
        (
            {"token_ids": [1], "stop_conditions": {"max_tokens": 20}},
            "max_tokens",
            "context_length_exceeded",
        ),
        ({"token_ids": [99999999]}, "prompt", None),
        ({"token_ids": [-1]}, "prompt", None),
        ({"token_ids": []}, "prompt", None),
        ({"token_ids": [1], "sampling_options": {"top_p": 2.0}}, "top_p", None),
        ({"token_ids": [1], "sampling_options": {"top_p": 0}}, "top_p", None),
        ({"token_ids": [1], "sampling_options": {"temperature": -1}}, "temperature", None),
        ({"token_ids": [1], "sampling_options": {"temperature": 2.5}}, "temperature", None),
        ({"token_ids": [1], "sampling_options": {"top_k": -2}}, "top_k", None),
        ({"token_ids": [1], "sampling_options": {"top_k": 1.5}}, "top_k", None),
        ({"token_ids": [1], "sampling_options": {"min_p": 1.5}}, "min_p", None),
        ({"token_ids": [1], "sampling_options": {"presence_penalty": 3}}, "presence_penalty", None),
        (
            {"token_ids": [1], "sampling_options": {"repetition_penalty": 0}},
            "repetition_penalty",
            None,
        ),
        ({"token_ids": [1], "sampling_options": {"seed": 2**70}}, "seed", None),
        ({"token_ids": [1], "sampling_options": {"n": 2}}, "n", None),
        ({"token_ids": [1], "sampling_options": {"logit_bias": {"16": 1}}}, "logit_bias", None),
        ({"token_ids": [1], "sampling_options": {"logit_bias": {"1": 101}}}, "logit_bias", None),
        (
            {"token_ids": [1], "sampling_options": {"guided_decoding": {"json": {}}}},
            "response_format",
            None,
        ),
        ({"token_ids": [1], "output_options": {"logprobs": 21}}, "logprobs", None),
        (
            {"token_ids": [1], "stop_conditions": {"max_tokens": 2, "min_tokens": 3}},
            "min_tokens",
            None,
        ),
    ],
)
def test_request_limits_refuse_what_can_never_succeed(
    request_: dict[str, object], param: str, code: str | None
) -> None:
    limits = RequestLimits(
        context_length=16, vocab_size=16, features=ALL_FEATURES - {"response_format"}
    )
    with pytest.raises(RequestError) as info:
        limits.check_request(request_)
    assert (info.value.status, info.value.param, info.value.code) == (400, param, code)
    body = openai.request_error_body(info.value)["error"]
    assert body["type"] == "invalid_request_error"
    assert body["param"] == param
    assert body["code"] == (code or 400)


def test_request_limits_let_through_what_fits() -> None:
    limits = RequestLimits(context_length=16, vocab_size=16, features=ALL_FEATURES)
    limits.check_request(
        {
            "token_ids": list(range(15)),
            "stop_conditions": {"max_tokens": 1, "min_tokens": 1, "ignore_eos": True},
            "sampling_options": {
                "temperature": 2,
                "top_p": 1,
                "top_k": -1,
                "seed": -(2**63),
                "logit_bias": {"15": -100.0},
                "presence_penalty": -2,
                "guided_decoding": {"json_object": True},
            },
            "output_options": {"logprobs": 20},
        }
    )
    # A neutral value of an option the engine lacks is no request for it.
    RequestLimits(features=frozenset()).check_request(
        {"token_ids": [1], "sampling_options": {"top_k": 0, "presence_penalty": 0.0}}
    )
    with pytest.raises(RequestError, match="not supported by this engine"):
        RequestLimits(features=frozenset()).check_request(
            {"token_ids": [1], "sampling_options": {"presence_penalty": 0.5}}
        )


@pytest.mark.parametrize(
    "body",
    [{}, {"prompt": 5}, {"prompt": ["a", "b"]}, {"prompt": []}],
)
def test_bad_prompts(body: dict[str, object]) -> None:
    with pytest.raises(RequestError, match="'prompt' must be"):
        openai.completion_prompt(body)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": 1}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "wizard"}]}, "messages[1].role"),
    ],
)
def test_bad_messages(body: dict[str, object], param: str) -> None:
    with pytest.raises(RequestError) as info:
        openai.chat_messages(body)
    assert info.value.param == param


def test_served_models() -> None:
    models = ServedModels(base="base", aliases=frozenset({"/models/base"}), created=1)
    models.adapters = {"a1": 5}
    assert models.resolve(None) is None
    assert models.resolve("base") is None
    assert models.resolve("/models/base") is None
    assert models.resolve("a1") == "a1"
    with pytest.raises(RequestError) as info:
        models.resolve("other")
    assert info.value.status == 404
    assert "The model `other` does not exist" in str(info.value)
    listing = models.listing()
    assert [entry["id"] for entry in listing["data"]] == ["base", "a1"]
    assert listing["data"][1]["parent"] == "base"


def test_finish_reasons() -> None:
    assert openai.openai_finish_reason("eos") == "stop"
    assert openai.openai_finish_reason("abort") == "cancelled"
    assert openai.openai_finish_reason("length") == "length"
    assert openai.openai_finish_reason("cancelled") == "cancelled"
