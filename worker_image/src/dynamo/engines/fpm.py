"""`ForwardPassEmitter`: how an engine hands its forward-pass metrics to the runtime.

The runtime attaches a sink (`attach_forward_pass_metrics_sink`); the engine then reports one
`ForwardPassMetrics` per scheduler iteration and data-parallel rank, from Welford
accumulators over the iteration's prefill and decode requests (and the queue), and an idle
heartbeat when a rank goes idle. A sink that raises loses one message, never the iteration.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from dynamo.common.forward_pass_metrics import (
    ForwardPassMetrics,
    QueuedRequestMetrics,
    ScheduledRequestMetrics,
    WelfordAccumulator,
)

logger = logging.getLogger(__name__)

ForwardPassMetricsSink = Callable[[ForwardPassMetrics], object]


class ForwardPassEmitter:
    """Builds and sends an engine's forward-pass metrics (nothing while no sink is attached)."""

    def __init__(self, sink: ForwardPassMetricsSink | None = None) -> None:
        self.sink = sink
        # The runtime's instance id, known once the engine starts.
        self.worker_id = ""

    @property
    def attached(self) -> bool:
        """Whether anyone receives the metrics (so they are worth computing)."""
        return self.sink is not None

    def iteration(
        self,
        *,
        dp_rank: int,
        counter_id: int,
        wall_time: float,
        prefill: WelfordAccumulator,
        decode: WelfordAccumulator,
        prefill_kv_tokens: int,
        queued: WelfordAccumulator | None = None,
    ) -> None:
        """One iteration of one rank: prefill lengths, decode KV lengths, waiting prompts."""
        scheduled = ScheduledRequestMetrics(
            num_prefill_requests=prefill.n,
            sum_prefill_tokens=int(prefill.s),
            var_prefill_length=prefill.variance(),
            sum_prefill_kv_tokens=prefill_kv_tokens,
            num_decode_requests=decode.n,
            sum_decode_kv_tokens=int(decode.s),
            var_decode_kv_tokens=decode.variance(),
        )
        waiting = QueuedRequestMetrics()
        if queued is not None:
            waiting = QueuedRequestMetrics(
                num_prefill_requests=queued.n,
                sum_prefill_tokens=int(queued.s),
                var_prefill_length=queued.variance(),
            )
        self._send(
            ForwardPassMetrics(
                worker_id=self.worker_id,
                dp_rank=dp_rank,
                counter_id=counter_id,
                wall_time=wall_time,
                scheduled_requests=scheduled,
                queued_requests=waiting,
            )
        )

    def heartbeat(self, *, dp_rank: int, counter_id: int) -> None:
        """An idle rank: no requests scheduled or queued."""
        self._send(
            ForwardPassMetrics(worker_id=self.worker_id, dp_rank=dp_rank, counter_id=counter_id)
        )

    def _send(self, metrics: ForwardPassMetrics) -> None:
        if self.sink is None:
            return
        try:
            self.sink(metrics)
        except Exception:
            logger.exception("forward-pass metrics sink failed; dropping one message")
