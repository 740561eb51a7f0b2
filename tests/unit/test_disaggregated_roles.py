"""Disaggregated serving on the worker side: the `--disaggregation-mode` flag, what each role
registers (component, worker type, needs, model type), the engines that refuse a role, and the
sample engine's prefill-to-decode hand-over (the protocol upstream's frontend drives)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from dynamo.common.backend import GenerateRequest
from dynamo.common.backend.disagg import prefill_only, received_kv_transfer_params
from dynamo.common.backend.health_check import HEALTH_CHECK_KEY
from dynamo.common.constants import DisaggregationMode
from dynamo.engines.sample import SampleEngine
from dynamo.runtime import cli
from dynamo.runtime.context import Context
from dynamo.runtime.discovery.records import model_card
from dynamo.runtime.errors import RequestError
from dynamo.runtime.registration import advertise

pytestmark = pytest.mark.unit

PROMPT = [7, 8, 9, 10]


async def sample_engine(mode: str) -> tuple[SampleEngine, Any]:
    engine, config = await SampleEngine.from_args(
        ["--max-tokens", "6", "--disaggregation-mode", mode]
    )
    await engine.start(1)
    return engine, config


@pytest.fixture
async def engines() -> AsyncIterator[dict[str, SampleEngine]]:
    started = {mode: (await sample_engine(mode))[0] for mode in ("agg", "prefill", "decode")}
    yield started
    for engine in started.values():
        await engine.cleanup()


async def collect(engine: SampleEngine, request: GenerateRequest) -> list[dict[str, Any]]:
    return [dict(chunk) async for chunk in engine.generate(request, Context())]


def tokens(chunks: list[dict[str, Any]]) -> list[int]:
    return [token for chunk in chunks for token in chunk["token_ids"]]


# --- flags and registration -------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "component", "worker_type", "needs", "model_type"),
    [
        ("agg", "backend", "aggregated", [], "Chat | Completions"),
        ("prefill", "prefill", "prefill", [["decode"]], "Prefill"),
        ("decode", "backend", "decode", [["prefill"]], "Chat | Completions"),
    ],
)
async def test_each_role_registers_as_upstream_does(
    mode: str, component: str, worker_type: str, needs: list[list[str]], model_type: str
) -> None:
    engine, config = await sample_engine(mode)
    try:
        assert config.disaggregation_mode is DisaggregationMode(mode)
        assert config.component == component
        engine_config = await engine.start(1)
        adv = advertise.build_advertisement(
            config,
            engine_config,
            instance_id=5,
            http_url="http://127.0.0.1:1",
            runtime_data={},
            taints=[],
            adapters={},
        )
        card = model_card(adv)
        assert (card["worker_type"], card["needs"], card["model_type"]) == (
            worker_type,
            needs,
            model_type,
        )
    finally:
        await engine.cleanup()


async def test_an_explicit_component_wins_over_the_role_default() -> None:
    _, config = await SampleEngine.from_args(
        ["--disaggregation-mode", "prefill", "--component", "prefill-a"]
    )
    assert config.component == "prefill-a"


def test_the_worker_passes_its_mode_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_DISAGGREGATION_MODE", "decode")
    args, extras = cli.build_parser().parse_known_args([])
    assert cli.engine_argv(args, "/m", extras)[-2:] == ["--disaggregation-mode", "decode"]
    args, extras = cli.build_parser().parse_known_args(["--disaggregation-mode", "prefill"])
    assert cli.engine_argv(args, "/m", extras)[-2:] == ["--disaggregation-mode", "prefill"]


def test_the_worker_refuses_an_unknown_mode(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_known_args(["--disaggregation-mode", "encode"])
    assert exited.value.code == cli.EXIT_USAGE
    assert "--disaggregation-mode" in capsys.readouterr().err


async def test_the_transformers_engine_refuses_a_role(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from dynamo.engines.transformers_engine import TransformersEngine

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exited:
        await TransformersEngine.from_args(
            ["--model", str(tmp_path), "--disaggregation-mode", "decode"]
        )
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--disaggregation-mode decode" in err
    assert "vllm" in err


# --- the request helpers ----------------------------------------------------------------


def test_prefill_only_caps_both_token_bounds_and_keeps_the_rest() -> None:
    request: GenerateRequest = {
        "token_ids": [1],
        "stop_conditions": {"max_tokens": 50, "min_tokens": 10, "stop_token_ids_hidden": [2]},
    }
    capped = prefill_only(request)
    assert capped["stop_conditions"] == {
        "max_tokens": 1,
        "min_tokens": 1,
        "stop_token_ids_hidden": [2],
    }
    assert request["stop_conditions"]["max_tokens"] == 50  # the caller's copy is untouched


@pytest.mark.parametrize(
    ("prefill_result", "expected"),
    [
        ({"disaggregated_params": {"kv_transfer_params": {"a": 1}}}, {"a": 1}),
        ({"disaggregated_params": None}, None),
        ({}, None),
    ],
)
def test_received_kv_transfer_params(
    prefill_result: dict[str, Any], expected: dict[str, Any] | None
) -> None:
    assert received_kv_transfer_params(prefill_result) == expected


# --- the sample engine's hand-over ------------------------------------------------------


async def test_prefill_then_decode_gives_the_aggregated_output(
    engines: dict[str, SampleEngine],
) -> None:
    request: GenerateRequest = {"token_ids": PROMPT, "stop_conditions": {"max_tokens": 5}}
    aggregated = await collect(engines["agg"], dict(request))  # type: ignore[arg-type]

    prefilled = await collect(engines["prefill"], dict(request))  # type: ignore[arg-type]
    assert len(prefilled) == 1
    assert len(prefilled[0]["token_ids"]) == 1
    assert prefilled[0]["finish_reason"] == "length"
    handed = prefilled[0]["disaggregated_params"]
    assert received_kv_transfer_params({"disaggregated_params": handed})

    details = {"cached_tokens": 2}
    decode_request: GenerateRequest = {
        **request,
        "prefill_result": {"disaggregated_params": handed, "prompt_tokens_details": details},
    }
    decoded = await collect(engines["decode"], decode_request)
    assert tokens(decoded) == tokens(aggregated)
    assert decoded[-1]["completion_usage"]["prompt_tokens_details"] == details


async def test_decode_refuses_a_request_that_skipped_prefill(
    engines: dict[str, SampleEngine],
) -> None:
    with pytest.raises(ValueError, match="no prefill_result"):
        await collect(engines["decode"], {"token_ids": PROMPT})


async def test_decode_refuses_the_prefill_of_another_prompt(
    engines: dict[str, SampleEngine],
) -> None:
    prefilled = await collect(engines["prefill"], {"token_ids": [1, 2, 3]})
    with pytest.raises(RequestError, match="not those of this prompt"):
        await collect(
            engines["decode"],
            {
                "token_ids": PROMPT,
                "prefill_result": {"disaggregated_params": prefilled[0]["disaggregated_params"]},
            },
        )


async def test_health_probes_run_whole_on_either_role(engines: dict[str, SampleEngine]) -> None:
    probe: GenerateRequest = {"token_ids": [1], "stop_conditions": {"max_tokens": 3}}
    probe[HEALTH_CHECK_KEY] = True  # type: ignore[literal-required]
    for role in ("prefill", "decode"):
        chunks = await collect(engines[role], dict(probe))  # type: ignore[arg-type]
        assert len(tokens(chunks)) == 3
        assert "disaggregated_params" not in chunks[-1]


def test_a_failed_kv_load_reaches_the_frontend_as_an_error_naming_it() -> None:
    # vLLM ends a decode request whose KV transfer failed with finish reason "error"; upstream's
    # frontend answers an "error: ..." finish with a 500 carrying the text.
    from dynamo.engines.vllm.engine import _FINISH_REASONS
    from dynamo.runtime.tcp_plane.messages import finish_reason

    reason = finish_reason(_FINISH_REASONS["error"])
    assert reason.startswith("error: ")
    assert "KV cache could not be loaded from the prefill worker" in reason
    assert finish_reason(_FINISH_REASONS["repetition"]) == "stop"
