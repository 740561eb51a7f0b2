"""vLLM's scheduler stats as our per-rank load snapshots and forward-pass metrics.

vLLM calls a stat logger per engine core (one per data-parallel rank) with each step's
`SchedulerStats`: `kv_cache_usage`, running and waiting counts, the step's prefix-cache
queries and hits, and (with `enable_logging_iteration_details`) the step's prefill and
decode request and token counts and its duration. `RankStats` turns those into what the
runtime publishes for the router: a `ComponentSnapshot` when the KV usage changes and one
`ForwardPassMetrics` per step, plus an idle heartbeat when the rank empties.

Duck-typed on vLLM's objects (their attribute names are the interface), so this module
imports no vLLM and is tested in the project venv.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any

from dynamo.common.backend import ComponentSnapshot
from dynamo.common.forward_pass_metrics import WelfordAccumulator
from dynamo.engines.fpm import ForwardPassEmitter

logger = logging.getLogger(__name__)


def _counts(requests: int, tokens: int) -> WelfordAccumulator:
    """An accumulator of `requests` observations summing to `tokens`.

    vLLM reports a step's totals, not each request's length, so the spread is unknown and
    reported as 0."""
    acc = WelfordAccumulator()
    acc.n = requests
    acc.s = tokens
    return acc


class RankStats:
    """One data-parallel rank's stat logger (vLLM's per-engine stat-logger interface)."""

    def __init__(
        self,
        *,
        dp_rank: int,
        total_blocks: int,
        emitter: ForwardPassEmitter,
        publisher: Any = None,
        background: set[asyncio.Future[Any]] | None = None,
    ) -> None:
        """`publisher.publish(rank, snapshot)` receives the snapshots (None: none sent);
        awaitable results are kept in `background` until done."""
        self.dp_rank = dp_rank
        self.total_blocks = total_blocks
        self.emitter = emitter
        self.publisher = publisher
        self._background = background if background is not None else set()
        self._last_snapshot: tuple[int, float | None] | None = None
        self._queries = 0
        self._hits = 0
        self._iterations = 0
        self._active = False
        # Blocks in use after the last engine step (0 before the first).
        self.kv_used_blocks = 0

    # vLLM's StatLoggerBase methods.
    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        """One engine step (vLLM calls this from its output handler)."""
        del iteration_stats, mm_cache_stats, engine_idx
        if scheduler_stats is None:
            return
        try:
            self._forward_pass(scheduler_stats)
            self._snapshot(scheduler_stats)
        except Exception:
            # Never let a metrics bug break vLLM's output handler.
            logger.exception("vLLM stats for rank %d not published", self.dp_rank)

    def log(self) -> None:
        """Periodic logging: our metrics are pushed per step, nothing to log here."""

    def log_engine_initialized(self) -> None:
        """Nothing to report: `VllmEngine.start` logs the allocation."""

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        """Sleep mode is not used by this engine."""

    # ----- what we publish -------------------------------------------------------------

    def hit_rate(self) -> float | None:
        """Prefix-cache hit rate over this rank's lifetime (None before any query)."""
        return self._hits / self._queries if self._queries else None

    def used_blocks(self, usage: float) -> int:
        """Blocks in use for vLLM's usage fraction."""
        return round(usage * self.total_blocks)

    def _snapshot(self, stats: Any) -> None:
        prefix = getattr(stats, "prefix_cache_stats", None)
        if prefix is not None:
            if getattr(prefix, "reset", False):
                self._queries = self._hits = 0
            self._queries += int(getattr(prefix, "queries", 0))
            self._hits += int(getattr(prefix, "hits", 0))
        usage = float(stats.kv_cache_usage)
        used = self.used_blocks(usage)
        self.kv_used_blocks = used
        key = (used, self.hit_rate())
        if self.publisher is None or key == self._last_snapshot:
            return
        self._last_snapshot = key
        snapshot = ComponentSnapshot(
            kv_used_blocks=used,
            kv_total_blocks=self.total_blocks,
            gpu_cache_usage=usage,
            dp_rank=self.dp_rank,
            kv_cache_hit_rate=self.hit_rate(),
        )
        result = self.publisher.publish(self.dp_rank, snapshot)
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(result)
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _forward_pass(self, stats: Any) -> None:
        if not self.emitter.attached:
            return
        details = getattr(stats, "iteration_details", None)
        if details is not None and not getattr(details, "is_dummy", False):
            self._active = True
            self._iterations += 1
            prefix = getattr(stats, "prefix_cache_stats", None)
            self.emitter.iteration(
                dp_rank=self.dp_rank,
                counter_id=self._iterations,
                wall_time=details.elapsed_ms / 1000.0,
                prefill=_counts(details.num_ctx_requests, details.num_ctx_tokens),
                # vLLM's step details count decode requests, not their KV lengths.
                decode=_counts(details.num_generation_requests, 0),
                # Prompt tokens found in the prefix cache this step.
                prefill_kv_tokens=int(getattr(prefix, "hits", 0)) if prefix is not None else 0,
                queued=_counts(stats.num_waiting_reqs, 0),
            )
        if self._active and stats.num_running_reqs + stats.num_waiting_reqs == 0:
            # The step that emptied the rank: one idle heartbeat.
            self._active = False
            self._iterations += 1
            self.emitter.heartbeat(dp_rank=self.dp_rank, counter_id=self._iterations)
