"""The worker's Prometheus registry, per-rank snapshot gauges and the FPM publisher."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dynamo.common.backend import ComponentSnapshot
from dynamo.common.backend.metrics import register_engine_registry
from dynamo.common.forward_pass_metrics import ForwardPassMetrics, ScheduledRequestMetrics, decode
from dynamo.runtime.fpm import FPM_TOPIC, ForwardPassPublisher
from dynamo.runtime.metrics import (
    EngineMetrics,
    ModelRequestMetrics,
    RuntimeMetrics,
    auto_labels,
)
from dynamo.runtime.snapshot import SnapshotPublisher

pytestmark = pytest.mark.unit

LABELS = auto_labels("ns", "backend", "generate", 0xABC123)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    wanted = {**LABELS, **labels}
    for (sample_name, sample_labels), sample_value in samples(text).items():
        if sample_name == name and dict(sample_labels) == wanted:
            return sample_value
    raise AssertionError(f"{name} {labels} not in the exposition")


def test_auto_labels_use_hex_worker_id() -> None:
    assert LABELS == {
        "dynamo_namespace": "ns",
        "dynamo_component": "backend",
        "dynamo_endpoint": "generate",
        "worker_id": "abc123",
    }


def test_request_lifecycle_and_lora_metrics() -> None:
    metrics = RuntimeMetrics(LABELS)
    metrics.requests.inc()
    metrics.inflight.inc()
    metrics.request_duration.observe(0.2)
    metrics.request_bytes.inc(10)
    metrics.response_bytes.inc(20)
    metrics.count_error("invalid_argument")
    metrics.cancellations.inc()
    gauges = metrics.set_model("/models/m", "m")
    gauges.model_load_time.set(1.5)
    metrics.lora_loaded.set(2)
    metrics.lora_load_duration.observe(0.3)
    metrics.count_lora_failure("digest mismatch")
    metrics.lora_downloaded_bytes.inc(1234)
    text = metrics.exposition()
    assert value(text, "dynamo_component_requests_total") == 1
    assert value(text, "dynamo_component_inflight_requests") == 1
    assert value(text, "dynamo_component_request_duration_seconds_count") == 1
    assert value(text, "dynamo_component_request_bytes_total") == 10
    assert value(text, "dynamo_component_response_bytes_total") == 20
    assert value(text, "dynamo_component_errors_total", error_type="invalid_argument") == 1
    assert value(text, "dynamo_component_cancellation_total") == 1
    # Upstream scopes these two wider: the process (worker_id only) and the component.
    exposed = samples(text)
    assert exposed[("dynamo_component_uptime_seconds", (("worker_id", "abc123"),))] >= 0
    component = (
        ("dynamo_component", "backend"),
        ("dynamo_namespace", "ns"),
        ("worker_id", "abc123"),
    )
    dropped = "dynamo_component_kv_publisher_engines_dropped_events_total"
    assert exposed[(dropped, component)] == 0
    metrics.kv_events_dropped.inc()
    assert samples(metrics.exposition())[(dropped, component)] == 1
    model = {"model": "/models/m", "model_name": "m"}
    assert value(text, "dynamo_component_model_load_time_seconds", **model) == 1.5
    assert value(text, "dynamo_component_drain_time_seconds", **model) == 0
    assert value(text, "dynamo_component_cleanup_time_seconds", **model) == 0
    assert value(text, "dynamo_component_lora_adapters_loaded") == 2
    assert value(text, "dynamo_component_lora_load_duration_seconds_count") == 1
    assert value(text, "dynamo_component_lora_load_failures_total", reason="digest mismatch") == 1
    assert value(text, "dynamo_component_lora_downloaded_bytes_total") == 1234
    assert "_created" not in text


def test_request_outcomes_and_token_timings_by_model_and_adapter() -> None:
    registry = CollectorRegistry()
    clock = iter([10.0, 10.25, 10.45, 10.85, 11.0])
    by_model = ModelRequestMetrics(registry, LABELS, clock=lambda: next(clock))
    observer = by_model.request("m")  # arrives at 10.0
    observer.resolved("sql")
    observer.tokens(1)  # first token 0.25 s after arrival
    observer.tokens(2)  # 0.2 s for two tokens: 0.1 s each
    observer.tokens(4)  # 0.4 s for four: 0.1 s each
    observer.finished()
    refused = by_model.request("m")
    refused.refused_by_budget()
    refused.failed("invalid_argument")
    refused.failed("internal")  # the first error is the outcome
    refused.cancelled = True
    refused.finished()
    text = generate_latest(registry).decode()
    sql = {"model": "m", "adapter": "sql"}
    base = {"model": "m", "adapter": ""}
    ttft = "dynamo_worker_time_to_first_token_seconds"
    assert value(text, ttft + "_sum", **sql) == 0.25
    assert value(text, ttft + "_bucket", **sql, le="0.22") == 0
    assert value(text, ttft + "_bucket", **sql, le="0.47") == 1
    itl = "dynamo_worker_inter_token_latency_seconds"
    assert value(text, itl + "_count", **sql) == 2
    assert value(text, itl + "_sum", **sql) == pytest.approx(0.2)
    assert value(text, "dynamo_worker_output_tokens_total", **sql) == 7
    success = {"status": "success", "error_type": ""}
    assert value(text, "dynamo_worker_requests_total", **sql, **success) == 1
    error = {"status": "error", "error_type": "invalid_argument"}
    assert value(text, "dynamo_worker_requests_total", **base, **error) == 1
    assert value(text, "dynamo_worker_token_budget_refusals_total", **base) == 1
    # Upstream's families keep upstream's labels: none of ours leak into them.
    metrics = RuntimeMetrics(LABELS)
    metrics.by_model.request("m").finished()
    text = metrics.exposition()
    assert {
        name
        for family in text_string_to_metric_families(text)
        if family.name.startswith("dynamo_component_")
        for sample in family.samples
        for name in sample.labels
    }.isdisjoint({"adapter", "status"})


def test_drain_timeouts_exceeded_counter_is_declared_at_zero() -> None:
    metrics = RuntimeMetrics(LABELS)
    gauges = metrics.set_model("/models/m", "m")
    model = {"model": "/models/m", "model_name": "m"}
    name = "dynamo_worker_drain_timeouts_exceeded_total"
    assert value(metrics.exposition(), name, **model) == 0
    gauges.drain_timeouts_exceeded.inc()
    assert value(metrics.exposition(), name, **model) == 1


def test_metrics_labels_extend_request_metrics() -> None:
    metrics = RuntimeMetrics(LABELS, extra_labels=[("team", "a")])
    metrics.requests.inc()
    text = metrics.exposition()
    assert value(text, "dynamo_component_requests_total", team="a") == 1


def test_engine_registry_is_bridged_with_auto_labels() -> None:
    metrics = RuntimeMetrics(LABELS)
    metrics.set_model("m", "m")
    registry = CollectorRegistry()
    Counter("vllm_steps", "engine steps", registry=registry).inc(3)
    handle = EngineMetrics(metrics)
    assert handle.auto_labels == {**LABELS, "model": "m", "model_name": "m"}
    register_engine_registry(handle, registry, prefix_filters=["vllm_"])
    handle.add_expfmt_callback(lambda: (_ for _ in ()).throw(RuntimeError("broken callback")))
    text = metrics.exposition()
    assert value(text, "vllm_steps_total", model="m", model_name="m") == 3


def test_snapshot_gauges_per_rank() -> None:
    metrics = RuntimeMetrics(LABELS)
    metrics.set_model("m", "served")
    publisher = SnapshotPublisher(metrics.registry, metrics.model_labels, [2, 3])
    model = {"model": "m", "model_name": "served"}
    text = metrics.exposition()
    for rank in ("2", "3"):
        assert value(text, "dynamo_component_total_blocks", dp_rank=rank, **model) == 0
        assert value(text, "dynamo_component_gpu_cache_usage_percent", dp_rank=rank, **model) == 0
    assert "dynamo_component_kv_cache_hit_rate{" not in text
    publisher.publish(3, ComponentSnapshot(10, 100, 0.1, dp_rank=3, kv_cache_hit_rate=0.5))
    publisher.publish(3, ComponentSnapshot(1, 100, 0.01, dp_rank=2))
    publisher.publish(0, "not a snapshot")  # type: ignore[arg-type]
    text = metrics.exposition()
    assert value(text, "dynamo_component_total_blocks", dp_rank="3", **model) == 100
    assert value(text, "dynamo_component_gpu_cache_usage_percent", dp_rank="3", **model) == 0.1
    assert value(text, "dynamo_component_kv_cache_hit_rate", dp_rank="3", **model) == 0.5
    assert value(text, "dynamo_component_gpu_cache_usage_percent", dp_rank="2", **model) == 0.01


async def test_fpm_publisher_wire_format() -> None:
    publisher = ForwardPassPublisher("127.0.0.1", 0, worker_id="42")
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(publisher.endpoint)
    message = ForwardPassMetrics(
        counter_id=7, scheduled_requests=ScheduledRequestMetrics(num_decode_requests=2)
    )
    try:
        # PUB drops messages until the subscription arrives: publish until one is received.
        frames = None
        for _ in range(500):
            publisher.publish(message)
            if await socket.poll(10):
                frames = await socket.recv_multipart()
                break
        assert frames is not None, "no message arrived"
        topic, sequence, payload = frames
        assert topic == FPM_TOPIC
        assert len(sequence) == 8
        decoded = decode(payload)
        assert decoded is not None
        assert decoded.worker_id == "42"  # stamped in
        assert decoded.counter_id == 7
        assert decoded.scheduled_requests.num_decode_requests == 2
        publisher.publish(message)
        following = await asyncio.wait_for(socket.recv_multipart(), 5)
        assert int.from_bytes(following[1], "big") == int.from_bytes(sequence, "big") + 1
    finally:
        socket.close()
        context.term()
        publisher.close()
        publisher.close()
    publisher.publish(message)  # closed: dropped silently


def test_fpm_port_in_use_names_the_variable() -> None:
    first = ForwardPassPublisher("127.0.0.1", 0)
    port = int(first.endpoint.rsplit(":", 1)[1])
    try:
        with pytest.raises(OSError, match="DYN_FORWARDPASS_METRIC_PORT"):
            ForwardPassPublisher("127.0.0.1", port)
    finally:
        first.close()
