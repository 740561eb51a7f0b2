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
    assert openai.sampling_options(body) == {"temperature": 0.5, "top_p": 0.9, "seed": 3}
    assert openai.stop_conditions(body, 7) == {"max_tokens": 7, "stop": ["\n"], "ignore_eos": True}
    assert openai.max_tokens_of({"max_completion_tokens": 4}, chat=True) == 4
    assert openai.max_tokens_of({"max_completion_tokens": 4}, chat=False) is None
    assert openai.completion_prompt({"prompt": ["hi"]}) == "hi"
    assert openai.completion_prompt({"prompt": [1, 2]}) == [1, 2]
    messages = openai.chat_messages(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}]}
    )
    assert messages == [{"role": "user", "content": "ab"}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 2}, "n"),
        ({"temperature": "hot"}, "temperature"),
        ({"best_of": 3}, "best_of"),
        ({"stop": [1]}, "stop"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_openai_bad_parameters(body: dict[str, object], param: str) -> None:
    def parse() -> None:
        openai.sampling_options(body)
        openai.stop_conditions(body, openai.max_tokens_of(body, chat=False))

    with pytest.raises(RequestError) as info:
        parse()
    assert info.value.param == param
    assert info.value.status == 400


@pytest.mark.parametrize(
    "body",
    [{}, {"prompt": 5}, {"prompt": ["a", "b"]}, {"prompt": []}],
)
def test_bad_prompts(body: dict[str, object]) -> None:
    with pytest.raises(RequestError, match="'prompt' must be"):
        openai.completion_prompt(body)


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"messages": []},
        {"messages": [{"content": "x"}]},
        {"messages": [{"role": "u", "content": 1}]},
    ],
)
def test_bad_messages(body: dict[str, object]) -> None:
    with pytest.raises(RequestError):
        openai.chat_messages(body)


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
