"""Reading a worker pod's load and KV-transfer counters (and an activator's held requests)
from its system port.

The autoscaler's one input, and the KV-transfer monitor's. Each read is `GET /metrics` on the
pod's system server, parsed with prometheus-client's own parser, so what is read is exactly
what Prometheus would scrape:

- `dynamo_component_inflight_requests`: requests in flight, queued in the engine included,
  summed over the pod's endpoints and models;
- `dynamo_component_gpu_cache_usage_percent`: the KV cache in use, a fraction per
  data-parallel rank (averaged, as a percent of the pod's blocks);
- `dynamo_worker_time_to_first_token_seconds`: the histogram's cumulative buckets, so the
  caller can take a p90 over the time between two reads (`ttft_p90`);
- on a disaggregated worker's pods, vLLM's NixlConnector counters (`KvTransferCounts`):
  `vllm:nixl_xfer_time_seconds` (its count: pulls), `vllm:nixl_bytes_transferred` (its sum),
  `vllm:nixl_num_failed_transfers` and `vllm:nixl_num_kv_expired_reqs`, summed over ranks;
- on an activator: `dynamo_activator_held_requests` and `dynamo_activator_card_ready`.

Reads share one bounded concurrency and each has a timeout, so a thousand pods cost at most
`concurrency` connections at once, and an unreachable pod costs one timeout, not a stall.
A pod that cannot be read is left out of the reading (None), not counted as idle.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from dynamo_operator.pods import routes

logger = logging.getLogger(__name__)

IN_FLIGHT = "dynamo_component_inflight_requests"
KV_USAGE = "dynamo_component_gpu_cache_usage_percent"
TTFT = "dynamo_worker_time_to_first_token_seconds"
HELD = "dynamo_activator_held_requests"
CARD_READY = "dynamo_activator_card_ready"
# vLLM's NixlConnector counters, by the sample that carries each (`KvTransferCounts` field).
KV_TRANSFER_SAMPLES = {
    "vllm:nixl_xfer_time_seconds_count": "transfers",
    "vllm:nixl_bytes_transferred_sum": "bytes_transferred",
    "vllm:nixl_num_failed_transfers_total": "failed_transfers",
    "vllm:nixl_num_kv_expired_reqs_total": "expired_requests",
}
# Cumulative bucket counts by upper bound (seconds; +Inf last).
Buckets = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class KvTransferCounts:
    """A pod's KV-cache transfer counters since it started (all 0 without vLLM's
    NixlConnector)."""

    transfers: float = 0.0
    bytes_transferred: float = 0.0
    failed_transfers: float = 0.0
    expired_requests: float = 0.0


@dataclass(frozen=True)
class PodReading:
    """One pod's load, as its `/metrics` said."""

    in_flight: float = 0.0
    kv_cache_percent: float | None = None
    ttft_buckets: Buckets = ()
    kv_transfer: KvTransferCounts = KvTransferCounts()


@dataclass(frozen=True)
class ActivatorReading:
    """An activator's held requests, and whether it holds the model card."""

    held: int = 0
    card_ready: bool = False


def parse_pod(text: str) -> PodReading:
    """A worker's `/metrics` text as a `PodReading`."""
    in_flight = 0.0
    usages: list[float] = []
    buckets: dict[float, float] = {}
    transfer: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == IN_FLIGHT:
                in_flight += sample.value
            elif sample.name == KV_USAGE:
                usages.append(sample.value)
            elif sample.name == TTFT + "_bucket":
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
            elif sample.name in KV_TRANSFER_SAMPLES:
                counter = KV_TRANSFER_SAMPLES[sample.name]
                transfer[counter] = transfer.get(counter, 0.0) + sample.value
    kv = 100.0 * sum(usages) / len(usages) if usages else None
    return PodReading(in_flight, kv, tuple(sorted(buckets.items())), KvTransferCounts(**transfer))


def parse_activator(text: str) -> ActivatorReading:
    """An activator's `/metrics` text as an `ActivatorReading`."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (HELD, CARD_READY):
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return ActivatorReading(int(values.get(HELD, 0)), values.get(CARD_READY, 0.0) >= 1.0)


def ttft_p90(before: Mapping[str, Buckets], after: Mapping[str, Buckets]) -> float | None:
    """The p90 time to first token over the requests that got their first token between two
    reads, over all pods (keyed by pod uid; a pod new in `after` counts from zero), linearly
    interpolated within the bucket that holds it, as Prometheus's histogram_quantile does;
    None without such a request."""
    totals: dict[float, float] = {}
    for pod, buckets in after.items():
        earlier = dict(before.get(pod, ()))
        for bound, count in buckets:
            delta = count - earlier.get(bound, 0.0)
            if delta < 0:  # the pod restarted: its counters began again
                delta = count
            totals[bound] = totals.get(bound, 0.0) + delta
    ordered = sorted(totals.items())
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = 0.9 * ordered[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # beyond the largest finite bucket: its bound is all we know
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return None


class LoadReader:
    """Reads pods' `/metrics` through `session`, at most `concurrency` at once."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        concurrency: int = 32,
        timeout_seconds: float = 2.0,
        url_for: Callable[[str], str] = lambda ip: routes.system_url(ip, routes.METRICS_PATH),
    ) -> None:
        self._session = session
        self._slots = asyncio.Semaphore(concurrency)
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._url_for = url_for

    async def _text(self, ip: str) -> str | None:
        async with self._slots:
            try:
                async with self._session.get(self._url_for(ip), timeout=self._timeout) as resp:
                    if resp.status != 200:
                        logger.debug("GET /metrics on %s: HTTP %s", ip, resp.status)
                        return None
                    return await resp.text()
            except (aiohttp.ClientError, TimeoutError) as exc:
                logger.debug("GET /metrics on %s: %s", ip, exc or type(exc).__name__)
                return None

    async def pod(self, ip: str) -> PodReading | None:
        """The load of the worker pod at `ip`; None when it did not answer."""
        text = await self._text(ip)
        return None if text is None else parse_pod(text)

    async def activator(self, ip: str) -> ActivatorReading | None:
        """The activator at `ip`; None when it did not answer."""
        text = await self._text(ip)
        return None if text is None else parse_activator(text)
