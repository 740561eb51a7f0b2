"""The worker's Prometheus registry: request, lifecycle, per-rank and LoRA metrics.

Names and labels follow upstream's Rust runtime: every metric is `dynamo_component_<name>`
with the auto labels `dynamo_namespace`, `dynamo_component`, `dynamo_endpoint` and
`worker_id` (lower-case hex of the instance id); lifecycle and per-rank gauges add `model`
and `model_name`. Two are scoped wider, as upstream's: `uptime_seconds` (the process: only
`worker_id`) and `kv_publisher_engines_dropped_events_total` (the component: no
`dynamo_endpoint`). Engines add their own registries through `EngineMetrics` expfmt
callbacks, whose text is appended to every scrape.

Upstream's worker has no per-model request outcome, TTFT, inter-token latency or output-token
families (its frontend has, as `dynamo_frontend_*`, measured at the frontend); ours are
`dynamo_worker_*` (`ModelRequestMetrics`), so that a Prometheus scraping upstream's frontend
and our workers never adds the two up. They carry the auto labels plus `model` (the served
base model) and `adapter` (the LoRA adapter a request resolved to, "" for the base model):
a request naming neither is labelled "" and counted `not_found`, never by the name it sent,
so `adapter` takes at most as many values as adapters were loaded in the process's life, at
any one time at most the LoRA capacity (`max_loras`) plus "".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

logger = logging.getLogger(__name__)

PREFIX = "dynamo_component_"
WORKER_PREFIX = "dynamo_worker_"
REQUEST_DURATION_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
LORA_LOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0)
# Upstream frontend's buckets for the same measurements, so panels compare like with like.
TTFT_BUCKETS = (
    0.0, 0.0022, 0.0047, 0.01, 0.022, 0.047, 0.1, 0.22, 0.47, 1.0, 2.2, 4.7, 10.0, 22.0, 48.0,
    100.0, 220.0, 480.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.0, 0.0018, 0.0033, 0.0059, 0.011, 0.02, 0.035, 0.064, 0.12, 0.21, 0.38, 0.69, 1.2, 2.3,
    4.1, 7.4, 13.0, 24.0, 44.0, 80.0,
)  # fmt: skip

ExpfmtCallback = Callable[[], str]


def auto_labels(namespace: str, component: str, endpoint: str, worker_id: int) -> dict[str, str]:
    """Upstream's automatic labels for component-scoped metrics."""
    return {
        "dynamo_namespace": namespace,
        "dynamo_component": component,
        "dynamo_endpoint": endpoint,
        "worker_id": format(worker_id, "x"),
    }


class RuntimeMetrics:
    """All runtime-owned metrics of one worker, in a registry of its own."""

    def __init__(
        self,
        labels: dict[str, str],
        *,
        extra_labels: Sequence[tuple[str, str]] = (),
    ) -> None:
        """`labels` are the auto labels; `extra_labels` (WorkerConfig.metrics_labels) are
        added to the request metrics."""
        # Upstream exposes no `*_created` series; this is process-wide, as is this runtime.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = dict(labels)
        self._started = time.monotonic()
        self._callbacks: list[ExpfmtCallback] = []
        request_labels = {**self.labels, **dict(extra_labels)}
        names = list(request_labels)
        registry = self.registry
        self.requests = Counter(
            PREFIX + "requests", "Requests received by the endpoint", names, registry=registry
        ).labels(**request_labels)
        self.request_duration = Histogram(
            PREFIX + "request_duration_seconds",
            "Time from request arrival to the end of its response",
            names,
            registry=registry,
            buckets=REQUEST_DURATION_BUCKETS,
        ).labels(**request_labels)
        self.inflight = Gauge(
            PREFIX + "inflight_requests", "Requests being processed", names, registry=registry
        ).labels(**request_labels)
        self.request_bytes = Counter(
            PREFIX + "request_bytes", "Request body bytes received", names, registry=registry
        ).labels(**request_labels)
        self.response_bytes = Counter(
            PREFIX + "response_bytes", "Response body bytes sent", names, registry=registry
        ).labels(**request_labels)
        self._errors = Counter(
            PREFIX + "errors",
            "Requests that failed, by error type",
            [*names, "error_type"],
            registry=registry,
        )
        self._request_labels = request_labels
        self.cancellations = Counter(
            PREFIX + "cancellation",
            "Requests cancelled (client gone or aborted at shutdown)",
            names,
            registry=registry,
        ).labels(**request_labels)
        process_labels = {"worker_id": self.labels["worker_id"]}
        uptime = Gauge(
            PREFIX + "uptime_seconds",
            "Seconds since the worker runtime started",
            list(process_labels),
            registry=registry,
        ).labels(**process_labels)
        uptime.set_function(lambda: time.monotonic() - self._started)
        component_labels = {
            name: value for name, value in self.labels.items() if name != "dynamo_endpoint"
        }
        self.kv_events_dropped = Counter(
            PREFIX + "kv_publisher_engines_dropped_events",
            "KV cache events the event plane dropped (subscribers too slow, or closed)",
            list(component_labels),
            registry=registry,
        ).labels(**component_labels)
        self._lora_metrics()
        self.by_model = ModelRequestMetrics(registry, self.labels)
        self.model_labels: dict[str, str] = {}

    def _lora_metrics(self) -> None:
        names = list(self.labels)
        registry = self.registry
        self.lora_loaded = Gauge(
            PREFIX + "lora_adapters_loaded", "LoRA adapters loaded", names, registry=registry
        ).labels(**self.labels)
        self.lora_load_duration = Histogram(
            PREFIX + "lora_load_duration_seconds",
            "Time to load a LoRA adapter (download included), successful or not",
            names,
            registry=registry,
            buckets=LORA_LOAD_BUCKETS,
        ).labels(**self.labels)
        self._lora_failures = Counter(
            PREFIX + "lora_load_failures",
            "LoRA adapter loads that failed, by reason",
            [*names, "reason"],
            registry=registry,
        )
        self.lora_downloaded_bytes = Counter(
            PREFIX + "lora_downloaded_bytes",
            "Bytes of LoRA adapters downloaded (cache hits and file:// count 0)",
            names,
            registry=registry,
        ).labels(**self.labels)

    def count_error(self, error_type: str) -> None:
        """Count one failed request of `error_type`."""
        self._errors.labels(**self._request_labels, error_type=error_type).inc()

    def count_lora_failure(self, reason: str) -> None:
        """Count one failed LoRA load with its reason."""
        self._lora_failures.labels(**self.labels, reason=reason).inc()

    def set_model(self, model: str, model_name: str) -> LifecycleGauges:
        """Create the lifecycle gauges once the engine reported its model."""
        self.model_labels = {**self.labels, "model": model, "model_name": model_name}
        return LifecycleGauges(self.registry, self.model_labels)

    def add_callback(self, callback: ExpfmtCallback) -> None:
        """Append `callback()`'s exposition text to every scrape."""
        self._callbacks.append(callback)

    def exposition(self) -> str:
        """The full `/metrics` text: this registry, then every callback's text.

        A failing callback is logged and skipped so one engine bug cannot hide the rest.
        """
        parts = [generate_latest(self.registry).decode("utf-8")]
        for callback in list(self._callbacks):
            try:
                text = callback()
            except Exception:
                logger.exception("metrics callback %r failed", callback)
                continue
            if text:
                parts.append(text if text.endswith("\n") else text + "\n")
        return "".join(parts)


class ModelRequestMetrics:
    """The `dynamo_worker_*` request families, by model and adapter (module docstring)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        labels: dict[str, str],
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.labels = dict(labels)
        self.clock = clock
        names = [*self.labels, "model", "adapter"]
        self.requests = Counter(
            WORKER_PREFIX + "requests",
            "Requests served, by model, adapter and outcome (status success, error or "
            "cancelled; error_type as dynamo_component_errors_total, '' unless an error)",
            [*names, "status", "error_type"],
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            WORKER_PREFIX + "time_to_first_token_seconds",
            "Time from request arrival to the engine's first output token",
            names,
            registry=registry,
            buckets=TTFT_BUCKETS,
        )
        self.inter_token_latency = Histogram(
            WORKER_PREFIX + "inter_token_latency_seconds",
            "Time between output tokens (one observation per engine chunk after the first: "
            "its gap over its token count)",
            names,
            registry=registry,
            buckets=ITL_BUCKETS,
        )
        self.output_tokens = Counter(
            WORKER_PREFIX + "output_tokens",
            "Output tokens the engine generated",
            names,
            registry=registry,
        )
        self.token_budget_refusals = Counter(
            WORKER_PREFIX + "token_budget_refusals",
            "Requests refused because the token budget could not fit them (answered 400 "
            "invalid_argument)",
            names,
            registry=registry,
        )

    def request(self, model: str) -> RequestObserver:
        """The observer of one request to `model`, which arrived now."""
        return RequestObserver(self, {**self.labels, "model": model, "adapter": ""})


class RequestObserver:
    """One request's outcome and token timings; `adapter` is set once `model` resolved."""

    def __init__(self, families: ModelRequestMetrics, labels: dict[str, str]) -> None:
        self._families = families
        self._labels = labels
        self._arrived = families.clock()
        self._last_token: float | None = None
        self.error_type = ""
        self.cancelled = False

    def resolved(self, adapter: str | None) -> None:
        """The request's `model` named `adapter` (None: the base model)."""
        self._labels["adapter"] = adapter or ""

    def failed(self, error_type: str) -> None:
        """The request failed; the first error is its outcome."""
        self.error_type = self.error_type or error_type

    def refused_by_budget(self) -> None:
        """The token budget refused the request."""
        self._families.token_budget_refusals.labels(**self._labels).inc()

    def tokens(self, count: int) -> None:
        """The engine produced `count` (> 0) output tokens in one chunk."""
        families = self._families
        now = families.clock()
        if self._last_token is None:
            families.time_to_first_token.labels(**self._labels).observe(now - self._arrived)
        else:
            gap = (now - self._last_token) / count
            families.inter_token_latency.labels(**self._labels).observe(gap)
        self._last_token = now
        families.output_tokens.labels(**self._labels).inc(count)

    def finished(self) -> None:
        """Count the request once, with its outcome."""
        if self.error_type:
            status = "error"
        elif self.cancelled:
            status = "cancelled"
        else:
            status = "success"
        self._families.requests.labels(
            **self._labels, status=status, error_type=self.error_type
        ).inc()


class LifecycleGauges:
    """`model_load_time_seconds`, `drain_time_seconds`, `cleanup_time_seconds`, and our
    `dynamo_worker_drain_timeouts_exceeded_total`."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            child: Gauge = Gauge(PREFIX + name, doc, names, registry=registry).labels(**labels)
            child.set(0)
            return child

        self.model_load_time = gauge("model_load_time_seconds", "Time engine.start took")
        self.drain_time = gauge("drain_time_seconds", "Time the shutdown drain took")
        self.cleanup_time = gauge("cleanup_time_seconds", "Time engine.cleanup took")
        self.drain_timeouts_exceeded = Counter(
            WORKER_PREFIX + "drain_timeouts_exceeded",
            "Drains whose budget ran out with requests still in flight (those were aborted)",
            names,
            registry=registry,
        ).labels(**labels)


class EngineMetrics:
    """What an engine's `register_prometheus(metrics)` receives.

    `auto_labels` are the labels to stamp on the engine's own metrics;
    `register_prometheus_expfmt_callback(fn)` adds `fn()`'s text to `/metrics`.
    """

    def __init__(self, runtime_metrics: RuntimeMetrics) -> None:
        self._runtime_metrics = runtime_metrics

    @property
    def auto_labels(self) -> dict[str, str]:
        """The worker's auto labels plus `model` and `model_name`."""
        return dict(self._runtime_metrics.model_labels or self._runtime_metrics.labels)

    def register_prometheus_expfmt_callback(self, callback: ExpfmtCallback) -> None:
        """Append `callback()` (Prometheus text) to every scrape."""
        self._runtime_metrics.add_callback(callback)

    def add_expfmt_callback(self, callback: ExpfmtCallback) -> None:
        """Alias of `register_prometheus_expfmt_callback`."""
        self._runtime_metrics.add_callback(callback)
