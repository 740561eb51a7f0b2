"""Forward-pass metrics (FPM): one message per engine scheduler iteration.

Wire format, version 1: a msgpack *map* keyed by field name (nested structs are maps too),
every field present, in declaration order. That is exactly what `msgspec.msgpack` produces
for the structs below, so the Rust relay and other readers can decode it by name.
"""

from __future__ import annotations

import logging

import msgspec

logger = logging.getLogger(__name__)

FPM_VERSION = 1


class WelfordAccumulator:
    """Welford's online algorithm for count / sum / population-variance.

    Numerically stable single-pass computation: it avoids the catastrophic cancellation
    that a sum-of-squares formula suffers with large values.
    """

    __slots__ = ("_m2", "_mean", "n", "s")

    def __init__(self) -> None:
        self.n: int = 0
        self.s: float = 0
        self._mean: float = 0.0
        self._m2: float = 0.0

    def add(self, v: int) -> None:
        """Add one observation."""
        self.n += 1
        self.s += v
        delta = v - self._mean
        self._mean += delta / self.n
        self._m2 += delta * (v - self._mean)

    def variance(self) -> float:
        """Population variance of the observations so far (0.0 when there are none)."""
        if self.n == 0:
            return 0.0
        return self._m2 / self.n


class ScheduledRequestMetrics(msgspec.Struct, frozen=True, gc=False):
    """Metrics for requests scheduled in this iteration."""

    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    sum_prefill_kv_tokens: int = 0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


class QueuedRequestMetrics(msgspec.Struct, frozen=True, gc=False):
    """Metrics for requests waiting in the queue (not scheduled this iteration).

    Token counts are raw totals: prefix-cache effects are unknown until a request is
    actually scheduled.
    """

    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


class ForwardPassMetrics(msgspec.Struct, frozen=True, gc=False):
    """Per-iteration metrics emitted by an instrumented scheduler.

    One message is emitted per scheduler iteration (one per forward pass). An idle
    heartbeat (all zeros, wall_time=0) is emitted once when the engine goes idle.
    """

    version: int = FPM_VERSION
    worker_id: str = ""
    dp_rank: int = 0
    counter_id: int = 0
    wall_time: float = 0.0
    scheduled_requests: ScheduledRequestMetrics = ScheduledRequestMetrics()
    queued_requests: QueuedRequestMetrics = QueuedRequestMetrics()


class UnsupportedFpmVersionError(Exception):
    """Raised when a ForwardPassMetrics message has an unrecognised version.

    Kept for API compatibility: `decode` reports unknown versions by returning None.
    """


# Reused across calls: building an encoder/decoder per message costs more than encoding.
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ForwardPassMetrics)


def encode(metrics: ForwardPassMetrics) -> bytes:
    """Serialize `metrics` to the version-1 wire format (a msgpack map)."""
    return _encoder.encode(metrics)


def decode(data: bytes) -> ForwardPassMetrics | None:
    """Decode a ForwardPassMetrics message, returning None for unknown versions.

    Returns None (and logs a warning) if the message cannot be decoded or carries a
    version this code does not understand, so callers can skip it without crashing.
    """
    try:
        metrics = _decoder.decode(data)
    except (msgspec.DecodeError, TypeError) as exc:
        logger.warning("Failed to decode ForwardPassMetrics message: %s", exc)
        return None
    if metrics.version != FPM_VERSION:
        logger.warning(
            "Skipping ForwardPassMetrics message with unsupported version %d (expected %d)",
            metrics.version,
            FPM_VERSION,
        )
        return None
    return metrics
