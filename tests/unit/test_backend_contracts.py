"""The unified engine contract (`dynamo.common.backend`): engines, configs and helpers."""

from __future__ import annotations

import enum
import json
import logging
import subprocess
import sys
import textwrap
from collections.abc import AsyncGenerator, Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from seed_api_table import SEED_API

from dynamo.common.backend import (
    BaseEngine,
    ComponentSnapshot,
    DiffusionEngine,
    EngineConfig,
    ForcedTokenSequenceSpec,
    GenerateChunk,
    GenerateRequest,
    LLMEngine,
    LlmRegistration,
    LogitsProcessorSpec,
    ModelInput,
    PushSource,
    PythonProcessorSpec,
    RawEngine,
    WorkerConfig,
    ZmqSource,
    disagg,
    dp_rank,
    health_check,
    metrics,
    multimodal,
    telemetry,
)
from dynamo.common.backend.logits_processing import (
    deserialize_logits_processor_entries,
    is_generation_stage,
    logits_processors_for_request,
    serialize_logits_processor_entries,
)
from dynamo.common.constants import DisaggregationMode
from dynamo.common.utils.prometheus import LabelInjectingCollector, get_prometheus_expfmt

pytestmark = pytest.mark.unit


class EchoEngine(LLMEngine):
    """Smallest complete LLM engine: echoes the prompt tokens back in one terminal chunk."""

    def __init__(self) -> None:
        self.started_with: int | None = None
        self.cleanups = 0

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[EchoEngine, WorkerConfig]:
        return cls(), WorkerConfig(namespace="test", model_name="echo")

    async def start(self, worker_id: int) -> EngineConfig:
        self.started_with = worker_id
        return EngineConfig(model="echo", llm=LlmRegistration(context_length=128))

    async def generate(
        self, request: GenerateRequest, context: Any
    ) -> AsyncGenerator[GenerateChunk, None]:
        yield GenerateChunk(token_ids=list(request["token_ids"]), index=0, finish_reason="stop")

    async def cleanup(self) -> None:
        self.cleanups += 1


class PictureEngine(DiffusionEngine):
    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[PictureEngine, WorkerConfig]:
        return cls(), WorkerConfig(namespace="test", model_input=ModelInput.Text)

    async def start(self, worker_id: int) -> EngineConfig:
        return EngineConfig(model="pic")

    async def generate(
        self, request: dict[str, Any], context: Any
    ) -> AsyncGenerator[dict[str, Any], None]:
        yield {"progress": 50}
        yield {"data": [{"b64_json": request["prompt"]}]}

    async def cleanup(self) -> None:
        return None


def test_abstract_engines_cannot_be_instantiated() -> None:
    with pytest.raises(TypeError):
        BaseEngine()  # type: ignore[abstract]

    class NoGenerate(LLMEngine):
        @classmethod
        async def from_args(cls, argv: list[str] | None = None) -> Any:
            return None

        async def start(self, worker_id: int) -> EngineConfig:
            return EngineConfig(model="m")

        async def cleanup(self) -> None:
            return None

    with pytest.raises(TypeError, match="generate"):
        NoGenerate()  # type: ignore[abstract]


async def test_llm_engine_lifecycle_and_defaults() -> None:
    engine, config = await EchoEngine.from_args([])
    assert config.model_name == "echo"
    engine_config = await engine.start(worker_id=0xABC)
    assert engine.started_with == 0xABC
    assert engine_config.llm is not None
    assert engine_config.llm.context_length == 128
    chunks = [chunk async for chunk in engine.generate({"token_ids": [1, 2]}, context=None)]
    assert chunks == [{"token_ids": [1, 2], "index": 0, "finish_reason": "stop"}]
    await engine.abort(None)
    assert await engine.is_quiescent() is None
    assert await engine.health_check_payload() is None
    assert engine.component_metrics_dp_ranks() == []
    assert engine.supported_controls() == set()
    assert engine.supported_updates() == set()
    assert await engine.engine_control("sleep", {}) == {
        "status": "error",
        "message": "unsupported engine control: sleep",
    }
    assert await engine.engine_update("load_lora", {}) == {
        "status": "error",
        "message": "unsupported engine update: load_lora",
    }
    assert await engine.kv_event_sources() == []
    assert await engine.logits_processor_spec() is None
    # The documented no-op defaults accept their argument without raising.
    await engine.register_prometheus(object())
    engine.attach_snapshot_publisher(object())
    await engine.on_endpoint_ready(object())
    await engine.cleanup()
    assert engine.cleanups == 1


async def test_raw_engine_yields_objects() -> None:
    engine, config = await PictureEngine.from_args(None)
    assert isinstance(engine, RawEngine)
    assert not isinstance(engine, LLMEngine)
    assert config.model_input is ModelInput.Text
    assert (await engine.start(1)).llm is None
    responses = [item async for item in engine.generate({"prompt": "cat"}, None)]
    assert responses == [{"progress": 50}, {"data": [{"b64_json": "cat"}]}]


def test_request_and_chunk_shapes() -> None:
    assert GenerateRequest.__required_keys__ == frozenset({"token_ids"})
    assert {"prefill_result", "multi_modal_data", "encoder_result", "routing", "model"} <= (
        GenerateRequest.__optional_keys__
    )
    assert GenerateChunk.__required_keys__ == frozenset({"token_ids", "index"})
    assert {"finish_reason", "completion_usage", "disaggregated_params", "engine_data"} <= (
        GenerateChunk.__optional_keys__
    )


def test_engine_config_and_registration_defaults() -> None:
    first, second = EngineConfig(model="a"), EngineConfig(model="b")
    first.model_aliases.append("alias")
    assert second.model_aliases == []
    assert (first.served_model_name, first.runtime_data, first.llm) == (None, None, None)
    assert all(getattr(LlmRegistration(), f.name) is None for f in fields(LlmRegistration))


def test_publisher_records() -> None:
    assert ZmqSource("tcp://127.0.0.1:5557") == ZmqSource("tcp://127.0.0.1:5557", "", 0)
    pushed: list[Any] = []
    source = PushSource(on_ready=pushed.append, dp_rank=2)
    source.on_ready("publisher")
    assert pushed == ["publisher"]
    assert source.dp_rank == 2
    snapshot = ComponentSnapshot(
        kv_used_blocks=3, kv_total_blocks=10, gpu_cache_usage=0.3, dp_rank=0
    )
    assert snapshot.kv_cache_hit_rate is None


# --- WorkerConfig ---------------------------------------------------------------------------


# The seed documents WorkerConfig's fields in order (positional callers depend on it).
WORKER_FIELD_ORDER = list(
    next(e.params for e in SEED_API if e.name == "WorkerConfig" and e.params is not None)
)


def test_worker_config_defaults_and_field_order() -> None:
    assert [f.name for f in fields(WorkerConfig)] == WORKER_FIELD_ORDER
    config = WorkerConfig("ns")
    assert config.component == "backend"
    assert config.endpoint == "generate"
    assert config.model_input is ModelInput.Tokens
    assert config.endpoint_types == "chat,completions"
    assert (config.discovery_backend, config.request_plane, config.event_plane) == (
        "etcd",
        "tcp",
        None,
    )
    assert config.disaggregation_mode is DisaggregationMode.AGGREGATED
    assert (config.structural_tag_mode, config.structural_tag_scope) == ("off", "auto")
    assert config.metrics_labels == []
    assert config.metrics_labels is not WorkerConfig("x").metrics_labels


class RuntimeConfig:
    """A Dynamo runtime-config-like object (as vLLM/TRT-LLM/SGLang configs carry)."""

    namespace = "prod"
    component = None
    endpoint = "serve"
    discovery_backend = "kubernetes"
    request_plane = "nats"
    event_plane = "nats"
    dyn_tool_call_parser = "hermes"
    dyn_reasoning_parser = "deepseek_r1"
    dyn_default_thinking_mode = "on"
    dyn_enable_structural_tag = True
    dyn_structural_tag_scope = "tools"
    enable_kv_routing = False
    kv_state_endpoint = "prod.backend.kv"
    route_to_encoder = True
    health_check_payload = '{"token_ids": [1]}'


class ForeignMode(enum.Enum):
    PREFILL = 1


def test_from_runtime_config_maps_fields() -> None:
    config = WorkerConfig.from_runtime_config(RuntimeConfig(), "org/model", served_model_name="m")
    assert config.namespace == "prod"
    assert config.component == "backend"  # None falls back
    assert config.endpoint == "serve"
    assert (config.model_name, config.served_model_name) == ("org/model", "m")
    assert (config.discovery_backend, config.request_plane, config.event_plane) == (
        "kubernetes",
        "nats",
        "nats",
    )
    assert (config.tool_call_parser, config.reasoning_parser) == ("hermes", "deepseek_r1")
    assert config.default_thinking_mode == "on"
    assert config.structural_tag_mode == "on"
    assert (config.structural_tag_scope, config.structural_tag_schema) == ("tools", "auto")
    assert config.enable_kv_routing is False
    assert config.enable_local_indexer is True
    assert config.kv_state_endpoint == "prod.backend.kv"
    assert config.route_to_encoder is True
    assert config.disaggregation_mode is DisaggregationMode.AGGREGATED
    assert config.health_check_payload == {"token_ids": [1], "_HEALTH_CHECK": True}
    assert config.model_input is ModelInput.Tokens


def test_from_runtime_config_disaggregation_mode_sources() -> None:
    class SGLangStyle(RuntimeConfig):
        serving_mode = ForeignMode.PREFILL

    class VllmStyle(RuntimeConfig):
        disaggregation_mode = DisaggregationMode.DECODE

    class Typo(RuntimeConfig):
        disaggregation_mode = "prefil"

    assert (
        WorkerConfig.from_runtime_config(SGLangStyle(), "m").disaggregation_mode
        is DisaggregationMode.PREFILL
    )
    assert (
        WorkerConfig.from_runtime_config(VllmStyle(), "m").disaggregation_mode
        is DisaggregationMode.DECODE
    )
    with pytest.raises(TypeError, match=r"disaggregation_mode is str\('prefil'\)"):
        WorkerConfig.from_runtime_config(Typo(), "m")
    # An override skips the probe entirely, so the typo never reaches the coercer.
    overridden = WorkerConfig.from_runtime_config(
        Typo(), "m", disaggregation_mode=DisaggregationMode.ENCODE, model_input=ModelInput.Text
    )
    assert overridden.disaggregation_mode is DisaggregationMode.ENCODE
    assert overridden.model_input is ModelInput.Text


def test_from_runtime_config_requires_core_fields() -> None:
    class Incomplete:
        namespace = "x"

    with pytest.raises(AttributeError, match="discovery_backend, request_plane, event_plane"):
        WorkerConfig.from_runtime_config(Incomplete(), "m")


# --- health checks --------------------------------------------------------------------------


@pytest.fixture
def no_payload_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_HEALTH_CHECK_PAYLOAD", raising=False)


def test_health_check_payload_default_and_extras(no_payload_env: None) -> None:
    assert health_check.HEALTH_CHECK_KEY == "_HEALTH_CHECK"
    payload = health_check.build_health_check_payload(7, extras={"model": "m"})
    assert payload == {
        "token_ids": [7],
        "stop_conditions": {"max_tokens": 1, "ignore_eos": True},
        "sampling_options": {"temperature": 0.0},
        "model": "m",
        "_HEALTH_CHECK": True,
    }
    assert health_check.is_probe(payload)
    assert not health_check.is_probe({"_HEALTH_CHECK": "true"})
    assert not health_check.is_probe({"token_ids": [1]})


def test_health_check_env_override_replaces_wholesale(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_HEALTH_CHECK_PAYLOAD", '{"prompt": "ping"}')
    assert health_check.build_health_check_payload(1) == {"prompt": "ping", "_HEALTH_CHECK": True}
    monkeypatch.setenv("DYN_HEALTH_CHECK_PAYLOAD", "{}")
    assert health_check.build_raw_health_check_payload({"prompt": "x"}) == {"_HEALTH_CHECK": True}


def test_health_check_env_override_from_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "canary.json"
    path.write_text('{"token_ids": [42]}')
    monkeypatch.setenv("DYN_HEALTH_CHECK_PAYLOAD", f"@{path}")
    assert health_check.load_health_check_from_env() == {"token_ids": [42]}


@pytest.mark.parametrize("value", ["not json", "[1, 2]", "@/no/such/file.json"])
def test_invalid_cli_payload_warns_and_gives_none(
    value: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert health_check.parse_health_check_payload_cli(value) is None
    assert "--health-check-payload" in caplog.text


def test_cli_payload(no_payload_env: None) -> None:
    assert health_check.parse_health_check_payload_cli(None) is None
    assert health_check.parse_health_check_payload_cli("") is None
    assert health_check.parse_health_check_payload_cli('{"a": 1}') == {
        "a": 1,
        "_HEALTH_CHECK": True,
    }


def test_bos_token_id_or() -> None:
    class Tokenizer:
        bos_token_id = 128000

    class Wrapper:
        tokenizer = Tokenizer()

    class NoBos:
        bos_token_id = None

    assert health_check.bos_token_id_or(Tokenizer()) == 128000
    assert health_check.bos_token_id_or(Wrapper()) == 128000
    assert health_check.bos_token_id_or(NoBos()) == 1
    assert health_check.bos_token_id_or(object(), default=2) == 2


# --- request helpers ------------------------------------------------------------------------


def test_disagg_helpers() -> None:
    request: GenerateRequest = {"token_ids": [1], "stop_conditions": {"max_tokens": 50}}
    assert disagg.enforce_prefill_max_tokens(request)["stop_conditions"] == {"max_tokens": 1}
    bare: GenerateRequest = {"token_ids": [1]}
    assert disagg.enforce_prefill_max_tokens(bare)["stop_conditions"] == {"max_tokens": 1}
    assert disagg.extract_prefill_result(bare) is None
    with pytest.raises(
        ValueError, match=r"^decode worker received request with no prefill_result;"
    ):
        disagg.require_prefill_result(bare, DisaggregationMode.DECODE)
    handoff = {"disaggregated_params": {"id": 1}}
    assert (
        disagg.require_prefill_result(
            {"token_ids": [], "prefill_result": handoff}, DisaggregationMode.DECODE
        )
        is handoff
    )


def test_dp_rank_helpers(caplog: pytest.LogCaptureFixture) -> None:
    assert dp_rank.forced_dp_rank({"token_ids": []}) is None
    assert dp_rank.forced_dp_rank({"token_ids": [], "routing": {"dp_rank": "3"}}) == 3
    assert dp_rank.validate_global_dp_rank(None, 0, 4, "vLLM") is None
    assert dp_rank.validate_global_dp_rank(2, 0, 1, "vLLM") is None
    assert dp_rank.validate_global_dp_rank(5, 4, 4, "vLLM") == 5
    with caplog.at_level(logging.WARNING):
        assert dp_rank.validate_global_dp_rank(8, 4, 4, "vLLM") is None
    assert "outside [4, 8); falling back to vLLM internal DP selection" in caplog.text


def test_multimodal_helpers() -> None:
    assert multimodal.extract_multimodal_kwargs({"token_ids": []}) is None
    request: GenerateRequest = {
        "token_ids": [],
        "multi_modal_data": {"image": ["u"]},
        "mm_processor_kwargs": {},
    }
    assert multimodal.extract_multimodal_kwargs(request) == {
        "multi_modal_data": {"image": ["u"]},
        "mm_processor_kwargs": {},
    }
    with pytest.raises(
        ValueError, match=r"^prefill worker received request with no encoder_result"
    ):
        multimodal.require_encoder_result({"token_ids": []}, DisaggregationMode.PREFILL)
    wrong_shape: Any = {"token_ids": [], "encoder_result": [1]}
    with pytest.raises(ValueError, match="must be a JSON object"):
        multimodal.require_encoder_result(wrong_shape, DisaggregationMode.AGGREGATED)
    assert multimodal.require_encoder_result(
        {"token_ids": [], "encoder_result": {"e": 1}}, DisaggregationMode.PREFILL
    ) == {"e": 1}
    assert multimodal.encoder_terminal_chunk({"e": 1}) == {
        "token_ids": [],
        "index": 0,
        "finish_reason": "stop",
        "encoder_result": {"e": 1},
    }
    usage = {"prompt_tokens": 3}
    assert (
        multimodal.encoder_terminal_chunk({}, completion_usage=usage)["completion_usage"] == usage
    )


# --- telemetry ------------------------------------------------------------------------------


class TracingContext:
    def __init__(self, headers: dict[str, str] | None) -> None:
        self.headers = headers
        self.started: list[tuple[str, dict[str, Any] | None]] = []

    def current_span(self) -> str:
        return "root-span"

    def start_span(self, name: str, attrs: dict[str, Any] | None) -> telemetry.NoopSpan:
        self.started.append((name, attrs))
        return telemetry.NoopSpan()

    def trace_headers(self) -> dict[str, str] | None:
        return self.headers


def test_telemetry_delegates_to_the_context() -> None:
    headers = {"traceparent": "00-abc-def-01"}
    context = TracingContext(headers)
    assert telemetry.current_span(context) == "root-span"
    with telemetry.start_span(context, "kv_load", blocks=8) as span:
        span.set_attribute("x", 1)
    assert context.started == [("kv_load", {"blocks": 8})]
    assert telemetry.trace_headers(context) == headers
    assert telemetry.engine_trace_kwargs(context) == {"trace_headers": headers}
    assert telemetry.engine_trace_kwargs(context, kwarg_name="trace") == {"trace": headers}
    assert telemetry.engine_trace_kwargs(context, enabled=False) == {}
    assert telemetry.engine_trace_kwargs(TracingContext(None)) == {}


def test_telemetry_is_a_noop_without_tracing_support() -> None:
    span = telemetry.current_span(object())
    span.set_attribute("a", 1)
    span.add_event("first_token", token_id=3)
    with telemetry.start_span(object(), "child") as child:
        child.set_status("ok")
    assert telemetry.trace_headers(object()) is None
    assert telemetry.engine_trace_kwargs(object()) == {}


# --- logits processors ----------------------------------------------------------------------


def test_logits_processor_gating_and_serialization() -> None:
    forced = ForcedTokenSequenceSpec(token_ids=(5, 6), eos_token_id=2)
    spec = LogitsProcessorSpec(entries=(forced,))
    assert is_generation_stage(DisaggregationMode.DECODE)
    assert not is_generation_stage(DisaggregationMode.PREFILL)
    assert (
        logits_processors_for_request(None, disaggregation_mode=DisaggregationMode.AGGREGATED) == []
    )
    assert logits_processors_for_request(spec, disaggregation_mode=DisaggregationMode.PREFILL) == []
    assert logits_processors_for_request(spec, disaggregation_mode=DisaggregationMode.DECODE) == [
        forced
    ]
    everywhere = LogitsProcessorSpec(entries=(forced,), generation_only=False)
    assert logits_processors_for_request(
        everywhere, disaggregation_mode=DisaggregationMode.ENCODE
    ) == [forced]

    payload = serialize_logits_processor_entries([forced])
    assert payload == [{"kind": "forced_sequence", "token_ids": [5, 6], "eos_token_id": 2}]
    assert deserialize_logits_processor_entries(json.loads(json.dumps(payload))) == [forced]
    with pytest.raises(TypeError, match="PythonProcessorSpec"):
        serialize_logits_processor_entries([PythonProcessorSpec(factory=object)])
    with pytest.raises(ValueError, match="unknown logits-processor entry kind 'bias'"):
        deserialize_logits_processor_entries([{"kind": "bias"}])


# --- metrics --------------------------------------------------------------------------------


class EngineMetricsRecorder:
    """Stands in for the runtime's EngineMetrics: auto labels plus recorded callbacks."""

    def __init__(self) -> None:
        self.auto_labels = {
            "dynamo_namespace": "ns",
            "dynamo_component": "backend",
            "worker_id": "1f",
        }
        self.callbacks: list[Callable[[], str]] = []

    def register_prometheus_expfmt_callback(self, callback: Callable[[], str]) -> None:
        self.callbacks.append(callback)

    def scrape(self) -> str:
        return "".join(callback() for callback in self.callbacks)


def engine_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    requests = Counter("vllm:requests", "Requests", ["model"], registry=registry)
    requests.labels(model="m").inc(3)
    latency = Histogram("vllm:latency_seconds", "Latency", buckets=(0.1, 1.0), registry=registry)
    latency.observe(0.5)
    # A label clash: the source's own worker_id must survive injection.
    Counter("vllm:own", "Own", ["worker_id"], registry=registry).labels(worker_id="keep").inc()
    Counter("python_gc_extra", "Noise", registry=registry).inc()
    return registry


def test_register_engine_registry_injects_labels_and_filters() -> None:
    recorder = EngineMetricsRecorder()
    metrics.register_engine_registry(recorder, engine_registry(), prefix_filters=["vllm:"])
    text = recorder.scrape()
    labels = 'dynamo_component="backend",dynamo_namespace="ns",model="m",worker_id="1f"'
    assert f"vllm:requests_total{{{labels}}} 3.0" in text
    assert 'le="0.1"' in text
    assert "vllm:latency_seconds_count{" in text
    assert (
        'vllm:own_total{dynamo_component="backend",dynamo_namespace="ns",worker_id="keep"} 1.0'
        in text
    )
    assert "# HELP vllm:requests_total Requests" in text
    assert "python_gc_extra" not in text
    assert text.endswith("\n")


def test_expfmt_exclude_prefixes_and_errors(caplog: pytest.LogCaptureFixture) -> None:
    text = get_prometheus_expfmt(engine_registry(), exclude_prefixes=["python_", "vllm:own"])
    assert "vllm:requests_total" in text
    assert "python_gc_extra" not in text
    assert "vllm:own" not in text
    with pytest.raises(ValueError, match="reserved Prometheus label"):
        LabelInjectingCollector(engine_registry(), {"le": "1"})
    with caplog.at_level(logging.ERROR):
        assert (
            get_prometheus_expfmt(engine_registry(), inject_custom_labels={"quantile": "x"}) == ""
        )


def test_ensure_prometheus_multiproc_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # setenv first so monkeypatch records the original state and undoes what the function
    # under test writes into os.environ itself.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "placeholder")
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    directory = metrics.ensure_prometheus_multiproc_dir("dyn-test-")
    assert directory is not None
    try:
        assert Path(directory.name).is_dir()
        assert Path(directory.name).name.startswith("dyn-test-")
        import os

        assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == directory.name
    finally:
        directory.cleanup()
    preset = tmp_path / "gone"
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(preset))
    assert metrics.ensure_prometheus_multiproc_dir("dyn-test-") is None
    assert preset.is_dir()


# The global REGISTRY and multiprocess mode are process-wide, so these run in a child.
GLOBAL_REGISTRY_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from prometheus_client import Counter
    from dynamo.common.backend.metrics import register_global_registry

    class Recorder:
        auto_labels = {"worker_id": "2a"}
        def __init__(self):
            self.callbacks = []
        def register_prometheus_expfmt_callback(self, callback):
            self.callbacks.append(callback)

    Counter("vllm:reqs", "in REGISTRY and the .db files").inc(2)
    Counter("lmcache:hits", "only in the .db files", registry=None).inc(5)
    recorder = Recorder()
    register_global_registry(
        recorder, engine_prefix="vllm:", multiproc_only_prefixes=["lmcache:"]
    )
    print(json.dumps([callback() for callback in recorder.callbacks]))
    """
)


def test_register_global_registry_in_multiprocess_mode(tmp_path: Path) -> None:
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    completed = subprocess.run(
        [sys.executable, "-c", GLOBAL_REGISTRY_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    outputs = json.loads(completed.stdout)
    joined = "".join(outputs)
    # The in-process counter clashes with the multiprocess collector, so the sources are
    # split: each metric appears exactly once across the callbacks.
    assert len(outputs) == 2
    assert joined.count("\nvllm:reqs_total{") + joined.startswith("vllm:reqs_total{") == 1
    assert 'lmcache:hits_total{worker_id="2a"} 5.0' in joined
    assert 'worker_id="2a"' in outputs[0]
