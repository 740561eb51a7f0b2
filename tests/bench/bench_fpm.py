"""Forward-pass-metrics encode+decode throughput, against plain msgspec on the same struct.

Run: `.venv/bin/pytest -m bench -s tests/bench/bench_fpm.py` (or run this file directly).
Prints figures only; nothing is asserted about speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import pytest

from dynamo.common.forward_pass_metrics import (
    ForwardPassMetrics,
    QueuedRequestMetrics,
    ScheduledRequestMetrics,
    decode,
    encode,
)

pytestmark = pytest.mark.bench

MESSAGES = 50_000
REPEATS = 5


def _message() -> ForwardPassMetrics:
    return ForwardPassMetrics(
        worker_id="7f3a9c21",
        dp_rank=3,
        counter_id=123_456,
        wall_time=0.0183,
        scheduled_requests=ScheduledRequestMetrics(
            num_prefill_requests=4,
            sum_prefill_tokens=8192,
            var_prefill_length=1024.5,
            sum_prefill_kv_tokens=2048,
            num_decode_requests=120,
            sum_decode_kv_tokens=250_000,
            var_decode_kv_tokens=88.25,
        ),
        queued_requests=QueuedRequestMetrics(num_prefill_requests=9, sum_prefill_tokens=30_000),
    )


def _best_rate(round_trip: Callable[[ForwardPassMetrics], object]) -> float:
    """Messages per second (best of REPEATS) for encode+decode of MESSAGES messages."""
    message = _message()
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(MESSAGES):
            round_trip(message)
        best = min(best, time.perf_counter() - start)
    return MESSAGES / best


def _ours(message: ForwardPassMetrics) -> object:
    return decode(encode(message))


def _plain_msgspec(message: ForwardPassMetrics) -> object:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=ForwardPassMetrics)


def run() -> dict[str, float]:
    ours = _best_rate(_ours)
    baseline = _best_rate(_plain_msgspec)
    figures = {"fpm_msgs_per_s": ours, "msgspec_msgs_per_s": baseline, "ratio": ours / baseline}
    print(
        f"FPM encode+decode: {ours:,.0f} msg/s; plain msgspec: {baseline:,.0f} msg/s; "
        f"ratio {figures['ratio']:.2f} ({len(encode(_message()))} bytes/message)"
    )
    return figures


def test_fpm_round_trip_throughput() -> None:
    figures = run()
    # Sanity only (the round trip happened); speed is reported, not judged.
    assert figures["fpm_msgs_per_s"] > 0


if __name__ == "__main__":
    run()
