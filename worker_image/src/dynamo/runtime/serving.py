"""`Serving`: what both request planes serve one engine with, built once by the lifecycle.

The HTTP plane (`dynamo.runtime.http_plane`) and upstream's TCP plane
(`dynamo.runtime.tcp_plane`) differ only in transport. The engine, the model names, the
metrics, the in-flight tracker (the drain), the token budget and the canary's success hook
are one object given to both, and so is the request handling they share: counting a request
in and out, resolving `model`, capping `max_tokens` by the budget, streaming through one
`EngineStreamer`, and classifying engine failures.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from dynamo.common.backend.engine import BaseEngine, RawEngine
from dynamo.common.token_budget import TokenBudget
from dynamo.runtime.budget import TokenBudgetExceeded, enforce_token_budget
from dynamo.runtime.context import Context
from dynamo.runtime.errors import RequestError
from dynamo.runtime.generation import EngineStreamer, StreamIncomplete
from dynamo.runtime.inflight import InflightRequest, InflightTracker
from dynamo.runtime.metrics import RuntimeMetrics
from dynamo.runtime.models import ServedModels
from dynamo.runtime.request_limits import RequestLimits

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Serving:
    """The serving dependencies and the request handling both planes share."""

    engine: BaseEngine
    models: ServedModels
    metrics: RuntimeMetrics
    tracker: InflightTracker
    budget: TokenBudget | None = None
    # What the engine publishes it accepts: every request is checked against it first.
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Called after each request that produced output without error (the canary uses it to
    # know the engine works).
    on_success: Callable[[], None] | None = None
    streamer: EngineStreamer = field(init=False)

    def __post_init__(self) -> None:
        self.streamer = EngineStreamer(self.engine)

    @property
    def raw(self) -> bool:
        """A raw engine: requests and responses pass through as JSON objects."""
        return isinstance(self.engine, RawEngine)

    @contextmanager
    def admitted(self, context: Context) -> Iterator[InflightRequest]:
        """Count one request in flight (tracker, request and in-flight metrics, duration),
        and its outcome by model and adapter when it ends."""
        started = time.perf_counter()
        metrics = self.metrics
        record = self.tracker.begin(context)
        record.observer = observer = metrics.by_model.request(self.models.base)
        metrics.requests.inc()
        metrics.inflight.inc()
        try:
            yield record
        finally:
            self.tracker.end(record)
            metrics.inflight.dec()
            metrics.request_duration.observe(time.perf_counter() - started)
            observer.finished()

    def failed(self, record: InflightRequest, error_type: str) -> None:
        """Count one failed request of `error_type` (`dynamo_component_errors_total` and
        the request's outcome)."""
        self.metrics.count_error(error_type)
        if record.observer is not None:
            record.observer.failed(error_type)

    def cancelled(self, record: InflightRequest) -> None:
        """The client went away (`dynamo_component_cancellation_total`, and the outcome)."""
        self.metrics.cancellations.inc()
        if record.observer is not None:
            record.observer.cancelled = True

    def resolve_model(self, record: InflightRequest, requested: object) -> str | None:
        """The adapter `requested` names (None: the base model), noted for the metrics; a 404
        `RequestError` for a name this worker does not serve."""
        adapter = self.models.resolve(requested)
        if record.observer is not None:
            record.observer.resolved(adapter)
        return adapter

    def check_budget(
        self, record: InflightRequest, prompt_tokens: int, max_tokens: int | None
    ) -> int | None:
        """The `max_tokens` the token budget allows; a 400 `RequestError` when it is spent."""
        try:
            return enforce_token_budget(self.budget, prompt_tokens, max_tokens)
        except TokenBudgetExceeded as exc:
            if record.observer is not None:
                record.observer.refused_by_budget()
            raise RequestError(str(exc), param="max_tokens") from None

    def token_request(
        self,
        record: InflightRequest,
        request: dict[str, Any],
        token_ids: list[int],
        requested_model: object,
    ) -> dict[str, Any]:
        """A `GenerateRequest` as the engine gets it: `model` resolved to the base model or
        a loaded adapter, `stop_conditions.max_tokens` capped by the token budget, checked
        against the engine's published limits (a 400 `RequestError` naming the field)."""
        engine_request = dict(request)
        engine_request["model"] = self.resolve_model(record, requested_model) or self.models.base
        conditions = request.get("stop_conditions")
        conditions = dict(conditions) if isinstance(conditions, dict) else {}
        max_tokens = self.check_budget(record, len(token_ids), conditions.get("max_tokens"))
        if max_tokens is not None and max_tokens != conditions.get("max_tokens"):
            conditions["max_tokens"] = max_tokens
            engine_request["stop_conditions"] = conditions
        self.limits.check_request(engine_request, prompt_param="token_ids")
        return engine_request

    def engine_failed(self, exc: Exception, record: InflightRequest) -> None:
        """Count and log a request that failed in the engine."""
        kind = "stream_incomplete" if isinstance(exc, StreamIncomplete) else "internal"
        self.failed(record, kind)
        request_id = record.context.id()
        logger.error("request %s failed in the engine: %s", request_id, exc, exc_info=exc)

    def succeeded(self) -> None:
        """A request produced its output without error."""
        if self.on_success is not None:
            self.on_success()
